"""The world outside the job: the gRPC client (`gradsync.remote.client.Client`, also importable as
`gradsync.client.Client`: pulls, named rows, pushes, stats, checkpoints). Importing this package loads no grpc."""
