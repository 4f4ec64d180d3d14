"""gradsync: data-parallel PyTorch training with a parameter server or allreduce behind one API."""

import importlib

_HOMES = {
    "init": "gradsync.runtime.start",
    "shutdown": "gradsync.runtime.leaving",
    "worker_rank": "gradsync.runtime.cluster",
    "num_workers": "gradsync.runtime.cluster",
    "restart_count": "gradsync.runtime.replacement",
    "Trainer": "gradsync.trainer",
    "RowSGD": "gradsync.tables.row_optim",
    "RowAdagrad": "gradsync.tables.row_optim",
    "DynamicEmbedding": "gradsync.tables.dynamic_embedding",
    "launch": "gradsync.launcher.launch",
    "JobFailed": "gradsync.core.errors",
    "log": "gradsync.metrics.scalars",
}
"""Where each public name lives. They load on first use, so `gradsync run` and `gradsync --help` start
without importing torch (seconds) before the ranks do."""

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
