"""The use cases, transport-neutral: one inference call's way (`pipeline`: admit, deadline, route) and what it does
(`inference`: classify, embed, infer), the control plane (`control`: versions, metadata, configuration, statistics,
the index, load and unload), admission and the pixel budget (`admission`), the per-process serving state
(`state`), keys, image preparation (`preprocess`), result encoding (`postprocess`), the map a client asks for
(`explanations`) and the stored inspections (`inspection`). Errors, deadlines, settings and metrics are the ground
floor's (service/ground/); the transports (service/http/, service/grpc/) translate to and from these calls."""
