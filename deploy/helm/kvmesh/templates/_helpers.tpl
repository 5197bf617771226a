{{/* Helm's labels on every object's metadata (not on pod templates or selectors). */}}
{{- define "kvmesh.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* An Istio cluster name: outbound|PORT||SERVICE.NAMESPACE.svc.DOMAIN */}}
{{- define "kvmesh.cluster" -}}
{{- printf "outbound|%v||%s.%s.svc.%s" (index . 1) (index . 0).name (index . 0).ns (index . 0).domain -}}
{{- end -}}

{{- define "kvmesh.workersCluster" -}}
{{- include "kvmesh.cluster" (list (dict "name" .Values.workers.serviceName "ns" .Release.Namespace "domain" .Values.clusterDomain) .Values.workers.port) -}}
{{- end -}}

{{- define "kvmesh.cpCluster" -}}
{{- include "kvmesh.cluster" (list (dict "name" "kvmesh-cp" "ns" .Release.Namespace "domain" .Values.clusterDomain) 18000) -}}
{{- end -}}

{{/* Where the native build reaches kvmesh-cp: the gateway's loopback link
(istio/overlays/native/envoyfilter-cp-link.yaml). */}}
{{- define "kvmesh.cpLinkAddress" -}}
{{- $link := .Files.Get "files/envoyfilter-cp-link.yaml" | fromYaml -}}
{{- $socket := (index $link.spec.configPatches 0).patch.value.address.socket_address -}}
{{- printf "http://%s:%d" $socket.address (int $socket.port_value) -}}
{{- end -}}

{{/* The Secret holding grpc-token and api-keys. */}}
{{- define "kvmesh.authSecret" -}}
{{- default "kvmesh-cp-auth" .Values.auth.existingSecret -}}
{{- end -}}

{{/*
The token and API keys, settled once per render (every template that needs them calls this
first): the values, else the Secret already in the cluster (an upgrade keeps them), else
random ones for the Secret this chart creates. With an existing Secret the token must be
readable (helm install/upgrade) or given (helm template).
*/}}
{{- define "kvmesh.settleAuth" -}}
{{- if not (hasKey . "kvmeshAuth") -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace (include "kvmesh.authSecret" .) -}}
{{- $data := dict -}}
{{- if $secret -}}{{- $data = default (dict) $secret.data -}}{{- end -}}
{{- $token := .Values.auth.grpcToken -}}
{{- if and (not $token) (hasKey $data "grpc-token") -}}{{- $token = index $data "grpc-token" | b64dec -}}{{- end -}}
{{- $keys := .Values.auth.apiKeys -}}
{{- if and (not $keys) (hasKey $data "api-keys") -}}{{- $keys = index $data "api-keys" | b64dec -}}{{- end -}}
{{- $workerKey := .Values.workers.apiKey -}}
{{- if and (not $workerKey) (hasKey $data "worker-api-key") -}}{{- $workerKey = index $data "worker-api-key" | b64dec -}}{{- end -}}
{{- if .Values.auth.existingSecret -}}
{{- if .Values.workers.apiKey -}}
{{- fail (printf "workers.apiKey: the chart does not write into auth.existingSecret (%s): put the key there as worker-api-key instead" .Values.auth.existingSecret) -}}
{{- end -}}
{{- if not $token -}}
{{- fail (printf "auth.existingSecret: no grpc-token could be read from the Secret %s in %s (helm template cannot read the cluster: pass the same token as auth.grpcToken)" .Values.auth.existingSecret .Release.Namespace) -}}
{{- end -}}
{{- else -}}
{{- if not $token -}}{{- $token = randAlphaNum 48 -}}{{- end -}}
{{- if not $keys -}}{{- $keys = printf "ops:ops:admin:%s" (randAlphaNum 48) -}}{{- end -}}
{{- end -}}
{{- $_ := set . "kvmeshAuth" (dict "token" $token "apiKeys" $keys "workerKey" $workerKey) -}}
{{- end -}}
{{- end -}}

{{/* `k=v` selector strings from a label map. */}}
{{- define "kvmesh.selectorList" -}}
{{- $out := list -}}
{{- range $k, $v := . -}}{{- $out = append $out (printf "%s=%s" $k $v) -}}{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The PD protocol's settings (pd.sglang, pd.vllm or pd.llm-d). */}}
{{- define "kvmesh.pdSettings" -}}
{{- $p := .Values.pd.protocol -}}
{{- if not (has $p (list "sglang" "vllm" "llm-d")) -}}
{{- fail (printf "pd.protocol: %q is not one of sglang, vllm, llm-d" $p) -}}
{{- end -}}
{{- toJson (index .Values.pd $p) -}}
{{- end -}}

{{/* kvmesh-cp's configuration file (its flags as YAML, docs/configuration.md). */}}
{{- define "kvmesh.cpConfig" -}}
{{- if not .Values.workerCidrs -}}
{{- fail "workerCidrs: set the cluster's pod network(s), e.g. --set 'workerCidrs={10.244.0.0/16}' (kvmesh-cp accepts workers only there)" -}}
{{- end -}}
{{- $c := dict
  "host" "0.0.0.0"
  "grpc-port" 18000
  "http-port" 18001
  "grpc-token-file" "/var/run/secrets/kvmesh/grpc-token"
  "service-discovery" true
  "service-discovery-namespace" .Release.Namespace
  "service-discovery-port" .Values.workers.port
  "selector" (include "kvmesh.selectorList" .Values.workers.selector | fromJsonArray)
  "worker-cidrs" .Values.workerCidrs
  "health-check-interval-secs" .Values.controlPlane.healthCheckIntervalSecs
  "leader-elect" true
  "log-level" .Values.controlPlane.logLevel
-}}
{{- if eq .Values.mode "pd" -}}
{{- $s := include "kvmesh.pdSettings" . | fromJson -}}
{{- $_ := set $c "pd-disaggregation" true -}}
{{- if ne .Values.pd.protocol "sglang" -}}{{- $_ := set $c "pd-protocol" .Values.pd.protocol -}}{{- end -}}
{{- range $key, $flag := dict "prefillFallback" "pd-prefill-fallback" "decider" "pd-decider" "nonCachedTokens" "non-cached-tokens" "prefillPolicy" "prefill-policy" "decodePolicy" "decode-policy" "roleLabel" "role-label" "bootstrapPortAnnotation" "bootstrap-port-annotation" "prefillSelector" "prefill-selector" "decodeSelector" "decode-selector" -}}
{{- if hasKey $s $key -}}{{- $_ := set $c $flag (index $s $key) -}}{{- end -}}
{{- end -}}
{{- else if eq .Values.mode "regular" -}}
{{- $_ := set $c "policy" .Values.policy -}}
{{- else -}}
{{- fail (printf "mode: %q is not regular or pd" .Values.mode) -}}
{{- end -}}
{{- if .Values.multiModel.enabled -}}
{{- $_ := set $c "enable-igw" true -}}
{{- if .Values.multiModel.aliases -}}{{- $_ := set $c "model-alias" .Values.multiModel.aliases -}}{{- end -}}
{{- end -}}
{{- if .Values.kvEvents.enabled -}}
{{- if not .Values.kvEvents.tokenizerConfigMap -}}
{{- fail "kvEvents.tokenizerConfigMap: name the ConfigMap with the model's tokenizer.json (event token ids become the text the gateways hash)" -}}
{{- end -}}
{{- $_ := set $c "kv-events-endpoint" .Values.kvEvents.endpoint -}}
{{- $_ := set $c "kv-events-tokenizer" "/etc/kvmesh/tokenizer/tokenizer.json" -}}
{{- if .Values.kvEvents.replayEndpoint -}}{{- $_ := set $c "kv-events-replay-endpoint" .Values.kvEvents.replayEndpoint -}}{{- end -}}
{{- if .Values.kvEvents.topic -}}{{- $_ := set $c "kv-events-topic" .Values.kvEvents.topic -}}{{- end -}}
{{- end -}}
{{- toYaml (mergeOverwrite $c .Values.controlPlane.extraConfig) -}}
{{- end -}}

{{/* The filter's plugin configuration (JSON): the same routing settings as kvmesh-cp's. */}}
{{- define "kvmesh.filterConfig" -}}
{{- include "kvmesh.settleAuth" . -}}
{{- $f := dict
  "max_payload_size" .Values.filter.maxPayloadSize
  "upstream_cluster" (include "kvmesh.workersCluster" .)
  "control_plane_cluster" (include "kvmesh.cpCluster" .)
  "control_plane_token" .kvmeshAuth.token
-}}
{{- if eq .Values.mode "pd" -}}
{{- $s := include "kvmesh.pdSettings" . | fromJson -}}
{{- $_ := set $f "pd_disaggregation" true -}}
{{- if ne .Values.pd.protocol "sglang" -}}{{- $_ := set $f "pd_protocol" .Values.pd.protocol -}}{{- end -}}
{{- range $key, $field := dict "prefillFallback" "pd_prefill_fallback" "decider" "pd_decider" "nonCachedTokens" "non_cached_tokens" "prefillPolicy" "prefill_policy" "decodePolicy" "decode_policy" -}}
{{- if hasKey $s $key -}}{{- $_ := set $f $field (index $s $key) -}}{{- end -}}
{{- end -}}
{{- else -}}
{{- $_ := set $f "policy" .Values.policy -}}
{{- end -}}
{{- toPrettyJson $f -}}
{{- end -}}
