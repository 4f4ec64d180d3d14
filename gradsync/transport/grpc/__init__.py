"""The gRPC transport, both sides, and every server's gRPC endpoint for the world outside the job.

job_calls.py (the transport: a worker's calls, a rank's start and serving), client.py (the outside world's
`gradsync.client.Client`, whose channels the workers' calls share), reply_streams.py (reading the reply streams
of pulls and pushes, for both), tls.py (why a connection fails for TLS), servicer.py (the servicer over
`ParameterServer`'s public methods), server.py (`serve_grpc`: the server and its handlers), admission.py
(tokens, member and outside calls, the admission limits), endpoint.py (serving a server's endpoint under any
transport), endpoint_files.py (`grpc-<shard>.json` and tokens in the run directory), plain_data.py (plain data
through the rendezvous store). Importing this package loads no grpc.
"""
