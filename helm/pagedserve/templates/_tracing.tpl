{{- /*
Traces (docs/design.md, "Traces"): every service of the chart sends its spans over OTLP/gRPC to
tracing.otlpEndpoint (a collector's http://HOST:4317), when set; each follows the W3C traceparent
of its caller, so one request is one trace from the client through the gateway and the compute
service to the memory service. Used in each service's args, at their indentation:
  {{- include "pagedserve.tracingArgs" . | nindent 12 }}
*/ -}}
{{- define "pagedserve.tracingArgs" -}}
{{- with .Values.tracing.otlpEndpoint -}}
- --otlp-traces-endpoint
- {{ . | quote }}
{{- end -}}
{{- end -}}
