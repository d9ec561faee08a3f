{{/*
Named templates. The kvd.* ones below the names are the chart's public surface: an engine's own
chart (with this chart as a dependency, or a copy of this file) adds kvd to its pods with them.
Each takes one dict:

  Values     values shaped like this chart's values.yaml (needs .image, .kvd, .shm); from a
             parent chart with kvd as a dependency: .Values.kvd
  role       "prefill" or "decode" (labels, and roles.<role>.kvdConfig when Values has it)
  configMap  name of the ConfigMap that holds kvd.yaml (render it with kvd.configMap)
  appVersion image tag when Values.image.tag is empty (optional)
  native     true: kvd goes under initContainers as a native sidecar (restartPolicy Always);
             false: under containers. Default: Values.kvd.nativeSidecar

In a parent chart's pod template:

  {{- $kvd := dict "Values" .Values.kvd "role" "decode" "configMap" "my-engine-kvd" "appVersion" "<kvd image tag>" }}
  initContainers:
    {{- include "kvd.sidecar" $kvd | nindent 4 }}
  containers:
    - name: engine
      volumeMounts:
        {{- include "kvd.engineVolumeMounts" $kvd | nindent 8 }}
  volumes:
    {{- include "kvd.sidecarVolumes" $kvd | nindent 4 }}

and, as its own manifest: {{ include "kvd.configMap" $kvd }}. The engine then connects to
unix:<listen_unix> (unix:/run/kvd/kvd.sock by default).
*/}}

{{- define "kvd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvd.fullname" -}}
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

{{/* Name of a role's objects (StatefulSet, headless Service): <fullname>-<role>. Arg: dict root role. */}}
{{- define "kvd.roleName" -}}
{{- printf "%s-%s" (include "kvd.fullname" .root | trunc 54 | trimSuffix "-") .role }}
{{- end }}

{{/* Labels every object of the chart carries. Arg: the root context. */}}
{{- define "kvd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvd
{{- end }}

{{/* Selector labels of one role's pods. Arg: dict root role. */}}
{{- define "kvd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/*
kvd's settings for a role, as a YAML map: Values.kvd.config with Values.roles.<role>.kvdConfig
over it. The only place the chart writes kvd settings from; the sidecar reads ports from it.
*/}}
{{- define "kvd.config" -}}
{{- $base := deepCopy .Values.kvd.config }}
{{- $roles := .Values.roles | default dict }}
{{- $role := get $roles .role | default dict }}
{{- $cfg := mergeOverwrite $base (deepCopy ($role.kvdConfig | default dict)) }}
{{- if $cfg.model }}{{- $_ := unset $cfg "layout" }}{{- end }}{{- /* a model's config.json replaces the layout (kvd refuses both) */}}
{{- toYaml $cfg }}
{{- end }}

{{/* The gRPC port of listen_tcp, refusing what the kubelet's probes and peers cannot reach. Arg: the config map. */}}
{{- define "kvd.grpcPort" -}}
{{- $tcp := .listen_tcp | default "" | toString }}
{{- if not (regexMatch "^(0\\.0\\.0\\.0|\\[::\\]|\\[?[0-9a-fA-F:.]*\\]?)?:[1-9][0-9]*$" $tcp) }}
{{- fail (printf "kvd config listen_tcp must be host:port with a fixed port on every interface (e.g. 0.0.0.0:50051): Kubernetes' gRPC probes and peer daemons reach kvd there; got %q" $tcp) }}
{{- end }}
{{- if regexMatch "^(127\\.|\\[::1\\]|localhost)" $tcp }}
{{- fail (printf "kvd config listen_tcp %q is loopback: the kubelet's gRPC probes and peer daemons come from outside the pod; use 0.0.0.0:<port>" $tcp) }}
{{- end }}
{{- regexReplaceAll "^.*:" $tcp "" }}
{{- end }}

{{/* The kvd container, as one list item. Arg: the dict described at the top. */}}
{{- define "kvd.sidecar" -}}
{{- $v := .Values }}
{{- $cfg := include "kvd.config" . | fromYaml }}
{{- $port := include "kvd.grpcPort" $cfg }}
{{- $native := ternary .native $v.kvd.nativeSidecar (hasKey . "native") }}
{{- $mooncake := eq ($cfg.backend | default "none") "mooncake" }}
{{- $mc := $v.kvd.mooncakePorts }}
{{- if and $mooncake (or (lt (int $mc.max) (add1 (int $mc.min))) (gt (sub (int $mc.max) (int $mc.min)) 15)) }}
{{- fail (printf "kvd.mooncakePorts: Mooncake draws two ports from [min, max]; give 2 to 16 ports, got [%v, %v]" $mc.min $mc.max) }}
{{- end -}}
- name: kvd
  image: "{{ $v.image.repository }}:{{ $v.image.tag | default .appVersion | required "kvd image.tag (or the chart's appVersion) is empty" }}"
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if $native }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", "--config", "/etc/kvd/kvd.yaml"]
  env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- if $v.kvd.advertisePodIP }}
    - name: KVD_ADVERTISE
      value: "$(POD_IP):{{ $port }}"
    {{- if $mooncake }}
    - name: KVD_TRANSFER_HOST
      value: "$(POD_IP)"
    {{- end }}
    {{- end }}
    {{- if $v.kvd.peerToken.secretName }}
    - name: KVD_PEER_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $v.kvd.peerToken.secretName }}
          key: {{ $v.kvd.peerToken.key }}
    {{- end }}
    {{- if eq ($cfg.backend | default "none") "nixl" }}
    - name: UCX_TCP_PORT_RANGE
      value: {{ printf "%v-%v" $v.kvd.nixlPorts.min $v.kvd.nixlPorts.max | quote }}
    {{- end }}
    {{- if $mooncake }}
    - name: MC_MIN_RPC_PORT
      value: {{ $v.kvd.mooncakePorts.min | quote }}
    - name: MC_MAX_RPC_PORT
      value: {{ $v.kvd.mooncakePorts.max | quote }}
    {{- end }}
    {{- with $v.kvd.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $port }}
    {{- if $cfg.metrics_port }}
    - name: metrics
      containerPort: {{ $cfg.metrics_port }}
    {{- end }}
    {{- if $mooncake }}
    {{- range $i, $p := untilStep (int $v.kvd.mooncakePorts.min) (int (add1 $v.kvd.mooncakePorts.max)) 1 }}
    - name: mooncake-{{ $i }}
      containerPort: {{ $p }}
    {{- end }}
    {{- end }}
  startupProbe:
    grpc:
      port: {{ $port }}
      service: kvd.v1.Kvd
    {{- toYaml $v.kvd.probes.startup | nindent 4 }}
  readinessProbe:
    grpc:
      port: {{ $port }}
      service: kvd.v1.Kvd
    {{- toYaml $v.kvd.probes.readiness | nindent 4 }}
  livenessProbe:
    grpc:
      port: {{ $port }}
    {{- toYaml $v.kvd.probes.liveness | nindent 4 }}
  resources:
    {{- toYaml $v.kvd.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.kvd.securityContext | nindent 4 }}
  volumeMounts:
    - name: kvd-config
      mountPath: /etc/kvd
      readOnly: true
    - name: kvd-tmp
      mountPath: /tmp
    {{- include "kvd.engineVolumeMounts" . | nindent 4 }}
{{- end }}

{{/* What the engine container mounts to reach kvd: the socket directory and the arena's tmpfs, at kvd's paths. */}}
{{- define "kvd.engineVolumeMounts" -}}
{{- $cfg := include "kvd.config" . | fromYaml -}}
{{- if $cfg.listen_unix -}}
- name: kvd-run
  mountPath: {{ dir $cfg.listen_unix }}
{{- end }}
- name: kvd-shm
  mountPath: {{ $cfg.arena_dir | default "/dev/shm" }}
{{- end }}

{{/* The pod volumes kvd.sidecar and kvd.engineVolumeMounts name, as list items. */}}
{{- define "kvd.sidecarVolumes" -}}
- name: kvd-config
  configMap:
    name: {{ .configMap }}
- name: kvd-tmp
  emptyDir: {}
- name: kvd-run
  emptyDir: {}
- name: kvd-shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end }}

{{/* The ConfigMap kvd reads (kvd.yaml: kvd.config of the role). Arg: the dict, plus "labels" (a YAML string, optional). */}}
{{- define "kvd.configMap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .configMap }}
  {{- with .labels }}
  labels:
    {{- . | nindent 4 }}
  {{- end }}
data:
  kvd.yaml: |
    {{- include "kvd.config" . | nindent 4 }}
{{- end }}

{{- /* The role's engine as YAML: values engine with roles.<role>.engine over it (the one place they
merge; read it back with fromYaml). Dict: Values, role. */}}
{{- define "kvd.engine" -}}
{{- $rv := get .Values.roles .role }}
{{- mergeOverwrite (deepCopy .Values.engine) (deepCopy ($rv.engine | default dict)) | toYaml }}
{{- end }}

{{- /* The containerPort of the role's engine port that metrics.serviceMonitor.enginePort names ("" when
none is scraped: the ServiceMonitor off, no enginePort, or no engine in this role's pods); fails
when the name is none of the engine's ports. Dict: Values, role. */}}
{{- define "kvd.engineMetricsPort" -}}
{{- $sm := .Values.metrics.serviceMonitor }}
{{- $engine := include "kvd.engine" . | fromYaml }}
{{- if and $sm.enabled $sm.enginePort (ne ($engine.image.repository | default "") "") }}
{{- $found := "" }}
{{- $names := list }}
{{- range $engine.ports }}
{{- $names = append $names (.name | default "") }}
{{- if eq (.name | default "") $sm.enginePort }}{{ $found = toString .containerPort }}{{ end }}
{{- end }}
{{- if not $found }}
{{- fail (printf "metrics.serviceMonitor.enginePort %q names none of the %s engine's ports (its engine.ports names: %v); name the port its /metrics is served on" $sm.enginePort .role $names) }}
{{- end }}
{{- $found }}
{{- end }}
{{- end }}
