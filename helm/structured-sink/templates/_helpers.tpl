{{/*
Names and labels.
*/}}
{{- define "structured-sink.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: fullnameOverride, else the release name when it already contains the
chart name, else "<release>-<chart>". Truncated to 63 characters (DNS label).
*/}}
{{- define "structured-sink.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "structured-sink.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "structured-sink.selectorLabels" -}}
app.kubernetes.io/name: {{ include "structured-sink.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "structured-sink.labels" -}}
helm.sh/chart: {{ include "structured-sink.chart" . }}
{{ include "structured-sink.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "structured-sink.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "structured-sink.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "structured-sink.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
Where the pod finds its files: the ConfigMap (config.toml) and the Secrets, each mounted whole in
its own directory (siblings, as a mount inside a ConfigMap volume cannot be created).
*/}}
{{- define "structured-sink.configDir" -}}/etc/structured-sink/config{{- end }}
{{- define "structured-sink.credentialsDir" -}}/etc/structured-sink/nats-credentials{{- end }}
{{- define "structured-sink.tlsDir" -}}/etc/structured-sink/nats-tls{{- end }}

{{/*
The port of config.http.listen ("HOST:PORT"), the service's default 9464 when unset: the
container port, the probes' and the Service's port all follow the service's own setting.
*/}}
{{- define "structured-sink.httpPort" -}}
{{- $listen := "0.0.0.0:9464" }}
{{- with .Values.config.http }}{{ with .listen }}{{ $listen = . }}{{ end }}{{ end }}
{{- splitList ":" $listen | last | int }}
{{- end }}

{{/*
The pod's terminationGracePeriodSeconds: the service's shutdown budget
(config.service.shutdown_timeout_ms, default 10000) rounded up to whole seconds, plus 7 seconds
for what follows it (up to 1 s for open HTTP connections, up to 5 s for the trace exporter's last
flush, and the exit), so Kubernetes never kills a shutdown that keeps its budget.
*/}}
{{- define "structured-sink.terminationGracePeriodSeconds" -}}
{{- $ms := 10000 }}
{{- with .Values.config.service }}{{ if hasKey . "shutdown_timeout_ms" }}{{ $ms = .shutdown_timeout_ms }}{{ end }}{{ end }}
{{- add (div (add (int64 $ms) 999) 1000) 7 }}
{{- end }}

{{/*
At most one kind of NATS authentication, as the service demands; the chart says so at render time.
*/}}
{{- define "structured-sink.checkNatsSecrets" -}}
{{- $s := .Values.natsSecrets }}
{{- $kinds := list }}
{{- if $s.credentials.secretName }}{{ $kinds = append $kinds "credentials" }}{{ end }}
{{- if $s.token.secretName }}{{ $kinds = append $kinds "token" }}{{ end }}
{{- if $s.userPassword.secretName }}{{ $kinds = append $kinds "userPassword" }}{{ end }}
{{- if $s.nkeySeed.secretName }}{{ $kinds = append $kinds "nkeySeed" }}{{ end }}
{{- if gt (len $kinds) 1 }}
{{- fail (printf "natsSecrets: set at most one kind of authentication, not %s" (join ", " $kinds)) }}
{{- end }}
{{- end }}

{{/*
Sets the dotted key .key (a configuration key such as "partitions.replica_count") to .value in
the map .config, creating the tables on the way. tests/it/deploy.rs checks every key set this
way against the service's configuration.
*/}}
{{- define "structured-sink.setKey" -}}
{{- $node := .config }}
{{- $parts := splitList "." .key }}
{{- range $part := initial $parts }}
{{- if not (hasKey $node $part) }}{{ $_ := set $node $part (dict) }}{{ end }}
{{- $node = index $node $part }}
{{- end }}
{{- $_ := set $node (last $parts) .value }}
{{- end }}

{{/*
The service configuration as TOML: .table is a map, .path its dotted name ("" at the top).
Helm's own toToml is not used: Helm reads every number in values as float64, and toToml writes
64 as 64.0, which the service's integer keys refuse (helm/helm#12987). Here a whole number is
written as an integer (the service has no fractional keys). A table's plain keys come first, then
its tables as [path.key] and its lists of tables as [[path.key]]; null values are left out (TOML
has no null; the key keeps its default). Keys come out sorted.
*/}}
{{- define "structured-sink.toml" -}}
{{- $path := .path }}
{{- range $key, $value := .table }}
{{- if not (or (kindIs "invalid" $value) (kindIs "map" $value) (include "structured-sink.isTableList" $value)) }}
{{ $key }} = {{ include "structured-sink.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $value := .table }}
{{- $name := $key }}
{{- if $path }}{{ $name = printf "%s.%s" $path $key }}{{ end }}
{{- if kindIs "map" $value }}

[{{ $name }}]
{{- include "structured-sink.toml" (dict "table" $value "path" $name) }}
{{- else if include "structured-sink.isTableList" $value }}
{{- range $item := $value }}

[[{{ $name }}]]
{{- include "structured-sink.toml" (dict "table" $item "path" $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the value is a non-empty list of maps (a TOML array of tables), else "". */}}
{{- define "structured-sink.isTableList" -}}
{{- if kindIs "slice" . }}{{ if gt (len .) 0 }}{{ if kindIs "map" (first .) }}true{{ end }}{{ end }}{{ end }}
{{- end }}

{{/* One TOML value: a string (JSON string escapes are TOML's), a bool, a number, a list. */}}
{{- define "structured-sink.tomlValue" -}}
{{- if kindIs "slice" . }}
{{- $items := list }}
{{- range $item := . }}{{ $items = append $items (include "structured-sink.tomlValue" $item) }}{{ end }}
{{- printf "[%s]" (join ", " $items) }}
{{- else if kindIs "string" . }}
{{- toJson . }}
{{- else if kindIs "bool" . }}
{{- ternary "true" "false" . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) }}
{{- if eq (float64 .) (float64 (int64 .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if kindIs "map" . }}
{{- fail "config: a table inside a list of plain values cannot be written as TOML" }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}
