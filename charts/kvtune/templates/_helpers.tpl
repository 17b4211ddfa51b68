{{/* Names, labels and the watched namespaces, shared by every template. */}}

{{- define "kvtune.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvtune.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvtune.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The namespaces the operator watches, one per line; empty when cluster-wide. */}}
{{- define "kvtune.watchNamespaces" -}}
{{- if .Values.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "clusterWide: true watches every namespace; leave watchNamespaces empty" -}}
{{- end -}}
{{- else -}}
{{- $namespaces := .Values.watchNamespaces | default (list .Release.Namespace) -}}
{{- range $namespaces | uniq }}
{{ . }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where the examples go: the first watched namespace, so their policies are watched and their pods
scraped where the operator looks (the release's namespace when cluster-wide, as every namespace is). */}}
{{- define "kvtune.examplesNamespace" -}}
{{- if .Values.clusterWide -}}
{{- .Release.Namespace -}}
{{- else -}}
{{- include "kvtune.watchNamespaces" . | trim | splitList "\n" | first -}}
{{- end -}}
{{- end -}}

{{- define "kvtune.peeringName" -}}
{{- .Values.peeringName | default (include "kvtune.fullname" .) -}}
{{- end -}}

{{/* An image reference; an empty repository fails the install naming the value to set (`what`): nothing
publishes kvtune's images, and a made-up default would end in ImagePullBackOff. */}}
{{- define "kvtune.image" -}}
{{- $repository := required (printf "%s.repository is not set: build the image (scripts/build_image.sh, README \"Install in a cluster\"), push it to your registry and set %s.repository" .what .what) .image.repository -}}
{{- printf "%s:%s" $repository (.image.tag | default .appVersion) -}}
{{- end -}}

{{/* The admin-token Secrets the operator may read: the values' list plus the enabled examples'. */}}
{{- define "kvtune.adminTokenSecrets" -}}
{{- $names := .Values.adminTokenSecrets -}}
{{- if .Values.examples.kvtuneEngine.enabled -}}
{{- $names = append $names (printf "%s-example-engine-admin" (include "kvtune.fullname" .)) -}}
{{- end -}}
{{- if .Values.examples.vllmProxy.enabled -}}
{{- $names = append $names (printf "%s-example-vllm-proxy-admin" (include "kvtune.fullname" .)) -}}
{{- end -}}
{{- range $names | uniq }}
{{ . }}
{{- end -}}
{{- end -}}

{{/* The hardened container securityContext every container of the chart runs with. */}}
{{- define "kvtune.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvtune.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsGroup }}
fsGroup: {{ .Values.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* An admin token kept across upgrades: the existing Secret's value when there is one, else a new one. */}}
{{- define "kvtune.adminToken" -}}
{{- $existing := lookup "v1" "Secret" .namespace .name -}}
{{- if and $existing $existing.data (index $existing.data "token") -}}
{{- index $existing.data "token" -}}
{{- else -}}
{{- randAlphaNum 40 | b64enc -}}
{{- end -}}
{{- end -}}

{{/* The rule groups of files/kvtune-rules.yaml as this release runs them: every raw engine series through
monitoring.prometheusRule.engineSelector (in place of the file's own, `fileSelector`), alerts in
monitoring.prometheusRule.disabled left out, its additionalRuleLabels added (an alert's own labels win), `for` overridden per alert,
each runbook_url on runbookBaseUrl when set, and the doctor command aimed at this release's Prometheus
(monitoring.prometheusRule.prometheusUrl). */}}
{{- define "kvtune.ruleGroups" -}}
{{- $values := .root.Values.monitoring.prometheusRule -}}
{{- $selector := printf "{%s}" (join ", " $values.engineSelector) -}}
{{- $fileSelector := .fileSelector -}}
{{- $groups := list -}}
{{- range $group := .groups -}}
{{- $kept := list -}}
{{- range $rule := $group.rules -}}
{{- $_ := set $rule "expr" (replace $fileSelector $selector $rule.expr) -}}
{{- if not (and $rule.alert (has $rule.alert $values.disabled)) -}}
{{- if $rule.alert -}}
{{- $_ := set $rule "labels" (merge (deepCopy $rule.labels) $values.additionalRuleLabels) -}}
{{- with index $values.for $rule.alert -}}
{{- $_ := set $rule "for" . -}}
{{- end -}}
{{- with $values.runbookBaseUrl -}}
{{- $page := regexReplaceAll "^.*/" $rule.annotations.runbook_url "" -}}
{{- $_ := set $rule.annotations "runbook_url" (printf "%s/%s" (trimSuffix "/" .) $page) -}}
{{- end -}}
{{- with $rule.annotations.doctor -}}
{{- $doctor := . -}}
{{- with $values.prometheusUrl -}}
{{- $doctor = replace "<PROMETHEUS_URL>" . $doctor -}}
{{- end -}}
{{- $_ := set $rule.annotations "doctor" $doctor -}}
{{- end -}}
{{- end -}}
{{- $kept = append $kept $rule -}}
{{- end -}}
{{- end -}}
{{- if $kept -}}
{{- $groups = append $groups (dict "name" $group.name "rules" $kept) -}}
{{- end -}}
{{- end -}}
{{- toYaml $groups -}}
{{- end -}}

{{/* The autoscalers' scaleDown: a lower count must hold for the stabilization window, then pods go a few per
period rather than every spare one at once, each draining its requests (vLLM's --shutdown-timeout, within
the Deployment's terminationGracePeriodSeconds). */}}
{{- define "kvtune.scaleDownBehavior" -}}
{{- with .Values.autoscaling.scaleDown -}}
scaleDown:
  stabilizationWindowSeconds: {{ .stabilizationWindowSeconds }}
  policies:
  - type: Pods
    value: {{ .podsPerPeriod }}
    periodSeconds: {{ .periodSeconds }}
{{- end -}}
{{- end -}}
