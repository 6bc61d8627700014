"""The payload processors the fabric runs on each message (docs/architecture.md, "A processor"):
the per-method chains (pipeline), validation by meaning (validation), upload compression
(compress) and the id-order fold of streamed replies (streaming).  Below the fabric: they see
`Payload`s and frames (common/wire), never an endpoint."""
