{{/* Labels of the CA's objects and its pods' selector (the same as deploy/base). */}}
{{- define "meshca.caSelector" -}}
app.kubernetes.io/name: meshca
app.kubernetes.io/component: ca
{{- end }}

{{- define "meshca.caLabels" -}}
{{ include "meshca.caSelector" . }}
app.kubernetes.io/part-of: meshca
{{- end }}

{{- define "meshca.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* The namespace Secret istiod-tls goes to. */}}
{{- define "meshca.istiodNamespace" -}}
{{ .Values.istiodTls.namespace | default .Release.Namespace }}
{{- end }}

{{/* CA_TRUSTED_NODE_ACCOUNTS: the operator's list, plus the node agent's account when on. */}}
{{- define "meshca.trustedNodeAccounts" -}}
{{- $accounts := list -}}
{{- with .Values.caTrustedNodeAccounts }}{{ $accounts = append $accounts . }}{{ end -}}
{{- if .Values.nodeAgent.enabled }}{{ $accounts = append $accounts (printf "%s/meshca-node-agent" .Release.Namespace) }}{{ end -}}
{{ join "," $accounts }}
{{- end }}

{{- define "meshca.nodeAgentSelector" -}}
app.kubernetes.io/name: meshca-node-agent
app.kubernetes.io/component: node-agent
{{- end }}

{{- define "meshca.nodeAgentLabels" -}}
{{ include "meshca.nodeAgentSelector" . }}
app.kubernetes.io/part-of: meshca
{{- end }}
