"""gradsync: data-parallel PyTorch training with a parameter server or allreduce behind one API."""
from gradsync.compare.scalars import log
from gradsync.core.row_optim import RowAdagrad, RowSGD
from gradsync.launcher.launch import launch
from gradsync.launcher.supervision import JobFailed
from gradsync.runtime.cluster import num_workers, worker_rank
from gradsync.runtime.leaving import shutdown
from gradsync.runtime.start import init
from gradsync.trainer import Trainer

__all__ = ["init", "shutdown", "worker_rank", "num_workers", "Trainer", "RowSGD", "RowAdagrad", "launch",
           "JobFailed", "log"]
