"""The documented import path of the outside-world client: `gradsync.client.Client` (it lives in
`gradsync.remote.client`)."""
from gradsync.remote.client import Client

__all__ = ["Client"]
