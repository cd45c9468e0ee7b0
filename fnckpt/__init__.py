"""fnckpt: checkpoints of JAX pytrees as pure functions.

``save(tree, path)`` returns once the arrays are off the devices and commits in the
background; ``restore(path, target)`` reads onto any mesh; ``metadata(path)`` describes a
checkpoint without reading its arrays. The guarantees are in docs/ (a site: ``mkdocs build``),
the format in docs/format.md.
"""

from ._version import __version__ as __version__
from ._version import check as _check_versions

_check_versions()  # an older JAX than the floor: one clear ImportError, before anything fails

from ._errors import BarrierTimeoutError as BarrierTimeoutError
from ._errors import CheckpointError as CheckpointError
from ._errors import NotCommittedError as NotCommittedError
from ._errors import TreeMismatchError as TreeMismatchError
from ._export.to_orbax import export_orbax as export_orbax
from ._export.to_safetensors import export_safetensors as export_safetensors
from ._format.perprocess import PerProcess as PerProcess
from ._manager.interval import optimal_interval_s as optimal_interval_s
from ._manager.manager import CheckpointManager as CheckpointManager
from ._restore.restore import ArrayMetadata as ArrayMetadata
from ._restore.restore import CheckpointMetadata as CheckpointMetadata
from ._restore.restore import SavedSharding as SavedSharding
from ._restore.restore import metadata as metadata
from ._restore.restore import restore as restore
from ._restore.target import target_from_metadata as target_from_metadata
from ._save.handle import SaveHandle as SaveHandle
from ._save.handle import SaveStats as SaveStats
from ._save.handle import wait as wait
from ._save.save import save as save

__all__ = [
  "save",
  "restore",
  "metadata",
  "wait",
  "target_from_metadata",
  "CheckpointManager",
  "PerProcess",
  "export_safetensors",
  "export_orbax",
  "optimal_interval_s",
  "SaveHandle",
  "SaveStats",
  "CheckpointMetadata",
  "ArrayMetadata",
  "SavedSharding",
  "CheckpointError",
  "TreeMismatchError",
  "NotCommittedError",
  "BarrierTimeoutError",
]
