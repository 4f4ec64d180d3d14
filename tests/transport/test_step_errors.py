"""A step's failure raises the same exception type, naming the server the same way (`server_name`), over torch
RPC as over gRPC: a timeout is a TimeoutError, a call the server refused a ValueError, its own failure a
RuntimeError. Single-process: torch futures stand in for torch RPC's, a gRPC error for the gRPC call's."""
import grpc
import pytest
import torch

from gradsync.core.errors import GradientError
from gradsync.core.torch_internals import RPC_TIMEOUT_TEXT
from gradsync.transport.grpc.client import Client
from gradsync.transport.rpc import wait_all


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _over_rpc(error: BaseException, as_value: bool) -> BaseException:
    """What wait_all raises for server 1's failure `error` (torch RPC raises a timeout, and hands a handler's
    error back as a value)."""
    done, failing = torch.futures.Future(), torch.futures.Future()
    done.set_result("fine")
    failing.set_result(error) if as_value else failing.set_exception(error)
    with pytest.raises(Exception) as raised:
        wait_all({0: done, 1: failing}, "push", timeout=60.0)
    return raised.value


def _over_grpc(code: grpc.StatusCode, details: str) -> BaseException:
    with Client({1: "127.0.0.1:1"}, token="t") as client:
        return client.error("JobPush", 1, 0.0, _Failed(code, details))


@pytest.mark.parametrize("rpc_error, as_value, code, kind", [
    (RuntimeError(f"{RPC_TIMEOUT_TEXT} (60000 ms) and will now be marked with an error"), False,
     grpc.StatusCode.DEADLINE_EXCEEDED, TimeoutError),
    (GradientError("bad shape"), True, grpc.StatusCode.INVALID_ARGUMENT, ValueError),
    (RuntimeError("server 1 failed answering worker 0's push"), True, grpc.StatusCode.INTERNAL, RuntimeError),
])
def test_both_transports_raise_the_same_type_naming_the_server_ps1(rpc_error, as_value, code, kind):
    over_rpc, over_grpc = _over_rpc(rpc_error, as_value), _over_grpc(code, str(rpc_error))
    assert type(over_rpc) is kind and type(over_grpc) is kind
    assert str(over_rpc).startswith("push on ps1 failed after ")
    assert str(over_grpc).startswith("JobPush on ps1 at 127.0.0.1:1 failed after ")
    assert str(rpc_error) in str(over_rpc) and str(rpc_error) in str(over_grpc)
