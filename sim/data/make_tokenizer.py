"""Makes sim/data/tokenizer.json: a small byte-level BPE (GPT-2's byte-to-unicode table, 256
byte tokens, merges learned from a fixed English text, one special token), in the layout of
Hugging Face's tokenizer.json, for kvmesh-sim and kvmesh-cp's KV-event tests.
Run: python3 sim/data/make_tokenizer.py > sim/data/tokenizer.json"""
import json
from collections import Counter

def byte_table():
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out

TEXT = """You are a helpful assistant. Answer the question below using the documents provided.
The quick brown fox jumps over the lazy dog. A system prompt shared by every tenant of the
service, followed by a question about the weather, the stock market, the history of the city,
and the recipe for bread. Summarise the following text in three sentences. Translate into
French. Write a function that returns the sum of the numbers in a list. """ * 4

def words(text):
    out, cur = [], ""
    for ch in text:
        if ch == " " and cur:
            out.append(cur)
            cur = ""
        cur += ch
    if cur:
        out.append(cur)
    return out

def main(merges_wanted=300):
    table = byte_table()
    vocab = {table[b]: b for b in range(256)}
    seqs = Counter(tuple(table[b] for b in w.encode()) for w in words(TEXT))
    merges = []
    while len(merges) < merges_wanted:
        pairs = Counter()
        for s, n in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        vocab[a + b] = len(vocab)
        new = Counter()
        for s, n in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            new[tuple(out)] += n
        seqs = new
    bos = len(vocab)
    doc = {
        "version": "1.0",
        "added_tokens": [{"id": bos, "content": "<|bos|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }
    print(json.dumps(doc, ensure_ascii=False, sort_keys=False))

main()
