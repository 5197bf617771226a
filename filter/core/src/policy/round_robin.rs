//! `round_robin`: the healthy workers in turn.

use super::Candidate;

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    pub fn pick(&mut self, cands: &[Candidate]) -> Option<usize> {
        if cands.is_empty() {
            return None;
        }
        let pos = self.next % cands.len();
        self.next = self.next.wrapping_add(1);
        Some(pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_through_candidates() {
        let cands: Vec<Candidate> = (0..3).map(|id| Candidate { id, load: 0 }).collect();
        let mut rr = RoundRobin::default();
        let picks: Vec<usize> = (0..6).filter_map(|_| rr.pick(&cands)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(rr.pick(&[]), None);
    }
}
