"""The documented import path of the outside-world client: `gradsync.client.Client` (it lives in
`gradsync.transport.grpc.client`)."""

from gradsync.transport.grpc.client import Client

__all__ = ["Client"]
