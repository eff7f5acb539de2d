{{/* Labels of every object of the release. */}}
{{- define "splitserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The Ray Serve application `splitserve serve` deploys, as JSON: from the values
given (`splitserve render --target helm CONFIG`), else from serve-values.yaml. Its args
are the serve config. */}}
{{- define "splitserve.application" -}}
{{- if .Values.application }}
{{- .Values.application | toJson }}
{{- else }}
{{- (.Files.Get "serve-values.yaml" | fromYaml).application | toJson }}
{{- end }}
{{- end }}

{{/* The environment of every Ray container: http.proxy haproxy (the default) runs
Ray Serve's HAProxy mode, read when Ray starts. */}}
{{- define "splitserve.rayEnv" -}}
{{- $http := (include "splitserve.application" . | fromJson).args.http | default dict }}
{{- if eq ($http.proxy | default "haproxy") "haproxy" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: "1"
{{- end }}
{{- end }}

{{/* The Ray Serve config file (serveConfigV2): that one application on the serve
config's port; `splitserve render --target serve-config` writes the same file. */}}
{{- define "splitserve.serveConfig" -}}
{{- $app := include "splitserve.application" . | fromJson }}
{{- $http := dict "host" $app.args.host "port" $app.args.port }}
{{- toYaml (dict "proxy_location" "EveryNode" "http_options" $http "applications" (list $app)) }}
{{- end }}
