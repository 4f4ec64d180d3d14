"""How ps workers reach the parameter servers: one module per transport, each with both sides.

`rpc` (torch RPC over TensorPipe, the default) and `grpc` (no TensorPipe at
all) each implement `base.WorkerTransport` (a worker's calls) and
`base.RankTransport` (a rank's start, a server's serving, leaving), and declare
their capabilities; `registry.transport(name)` finds them by the `transport`
setting's value. On a server both translate messages into calls on a
`gradsync.ps.server.ParameterServer`. Members of one job exchange flat buckets
of the shared bucket plan; names are for clients outside the job
(`gradsync.client.Client`, through `endpoint`).
"""
