{{/* Name prefix of every object. */}}
{{- define "eddy.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "eddy.labels" -}}
app.kubernetes.io/part-of: eddy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "eddy.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The NATS URL components connect to. */}}
{{- define "eddy.natsUrl" -}}
{{- if .Values.nats.enabled -}}
nats://{{ .Release.Name }}-nats.{{ .Release.Namespace }}.svc.cluster.local:4222
{{- else -}}
{{- required "externalNats.url is required when nats.enabled is false" .Values.externalNats.url -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the dispatcher's admin token (key `token`). */}}
{{- define "eddy.dispatcherAdminSecret" -}}
{{- .Values.dispatcher.admin.tokenSecret | default (printf "%s-dispatcher-admin" (include "eddy.fullname" .)) -}}
{{- end -}}

{{/* SPIFFE identity of a component's service account. */}}
{{- define "eddy.principal" -}}
cluster.local/ns/{{ .root.Release.Namespace }}/sa/{{ include "eddy.fullname" .root }}-{{ .component }}
{{- end -}}

{{/* Hardened security context of eddy's own containers. */}}
{{- define "eddy.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile: {type: RuntimeDefault}
{{- end -}}
{{- define "eddy.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities: {drop: [ALL]}
{{- end -}}

{{/*
The chart's own NATS: the component's user, its password from the Secret <release>-nats-auth
(its own key only) and its inbox prefix (replies to it alone), as files/nats-users.json says.
Called with (dict "root" $ "key" "event-bus").
*/}}
{{- define "eddy.natsUserEnv" -}}
{{- if .root.Values.nats.enabled }}
{{- $key := .key }}
{{- range (.root.Files.Get "files/nats-users.json" | fromJson).users }}
{{- if eq .secretKey $key }}
- {name: EDDY_NATS_USER, value: {{ .user | quote }}}
- name: EDDY_NATS_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ printf "%s-nats-auth" $.root.Release.Name }}, key: {{ $key }}}}
- {name: EDDY_NATS_INBOX_PREFIX, value: {{ .inboxPrefix | quote }}}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A list of NATS subjects in nats.conf's syntax (toJson would escape `>`). */}}
{{- define "eddy.natsSubjects" -}}
[{{ range $i, $subject := . }}{{ if $i }}, {{ end }}{{ $subject | quote }}{{ end }}]
{{- end -}}

{{/* NATS credentials, mounted when configured. */}}
{{- define "eddy.natsCredsEnv" -}}
{{- if .Values.externalNats.credsSecret }}
- name: EDDY_NATS_CREDS
  value: /etc/eddy/nats/creds
{{- end }}
{{- end -}}
{{- define "eddy.natsCredsMount" -}}
{{- if .Values.externalNats.credsSecret }}
- name: nats-creds
  mountPath: /etc/eddy/nats
  readOnly: true
{{- end }}
{{- end -}}
{{- define "eddy.natsCredsVolume" -}}
{{- if .Values.externalNats.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ .Values.externalNats.credsSecret }}
{{- end }}
{{- end -}}

{{/* trustedCA.configMap: extra CA certificates trusted besides the image's public roots (rustls reads both SSL_CERT_FILE and SSL_CERT_DIR). */}}
{{- define "eddy.trustedCaEnv" -}}
{{- if .Values.trustedCA.configMap }}
- {name: SSL_CERT_FILE, value: /etc/ssl/certs/ca-certificates.crt}
- {name: SSL_CERT_DIR, value: /etc/eddy/trusted-ca}
{{- end }}
{{- end -}}
{{- define "eddy.trustedCaMount" -}}
{{- if .Values.trustedCA.configMap }}
- name: trusted-ca
  mountPath: /etc/eddy/trusted-ca
  readOnly: true
{{- end }}
{{- end -}}
{{- define "eddy.trustedCaVolume" -}}
{{- if .Values.trustedCA.configMap }}
- name: trusted-ca
  configMap:
    name: {{ .Values.trustedCA.configMap }}
    items: [{key: ca.crt, path: ca.crt}]
{{- end }}
{{- end -}}

{{/* gateway.extensionProviders: Istio's extensionProviders, in a ConfigMap the gateway and the controller (APIRule status) read. */}}
{{/*
The names the gateway's own /<namespace>/<function> routes answer to (its Service's DNS names,
the hosts it is exposed on, localhost): no APIRule may take one. Wildcards reserve nothing.
*/}}
{{- define "eddy.gatewayHostsEnv" -}}
{{- $name := printf "%s-gateway" (include "eddy.fullname" .) -}}
{{- $ns := .Release.Namespace -}}
{{- $hosts := list "localhost" $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.cluster.local" $name $ns) -}}
{{- range .Values.gateway.expose.hosts }}{{ if not (contains "*" .) }}{{ $hosts = append $hosts . }}{{ end }}{{ end -}}
- {name: EDDY_GATEWAY_HOSTS, value: {{ join "," $hosts | quote }}}
{{- end -}}

{{- define "eddy.extensionProvidersEnv" -}}
{{- if .Values.gateway.extensionProviders }}
- {name: EDDY_EXTENSION_PROVIDERS, value: /etc/eddy/extension-providers/providers.yaml}
{{- end }}
{{- end -}}
{{- define "eddy.extensionProvidersMount" -}}
{{- if .Values.gateway.extensionProviders }}
- name: extension-providers
  mountPath: /etc/eddy/extension-providers
  readOnly: true
{{- end }}
{{- end -}}
{{- define "eddy.extensionProvidersVolume" -}}
{{- if .Values.gateway.extensionProviders }}
- name: extension-providers
  configMap:
    name: {{ include "eddy.fullname" . }}-extension-providers
{{- end }}
{{- end -}}
{{- define "eddy.extensionProvidersChecksum" -}}
{{- if .Values.gateway.extensionProviders }}
checksum/extension-providers: {{ toYaml .Values.gateway.extensionProviders | sha256sum | quote }}
{{- end }}
{{- end -}}

{{- define "eddy.functionPresetsChecksum" -}}
{{- if .Values.controller.functionPresets }}
checksum/function-presets: {{ toYaml .Values.controller.functionPresets | sha256sum | quote }}
{{- end }}
{{- end -}}

{{- define "eddy.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}

{{/* Trace export (OTLP/HTTP), when tracing.otlpEndpoint is set: every component sends its spans there, and the controller gives functions the same collector. */}}
{{- define "eddy.tracesEnv" -}}
{{- if .Values.tracing.otlpEndpoint }}
- name: EDDY_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
- name: EDDY_OTLP_PROTOCOL
  value: {{ .Values.tracing.protocol | quote }}
{{- end }}
{{- end -}}
