"""The errors the checkpoint package raises on purpose (callers catch `CheckpointError`)."""


class CheckpointError(Exception):
    """Base class of every error this module raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint (or frozen tree) where one was asked for."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's tree structure or shapes differ from the restore target."""


class CheckpointSaveError(CheckpointError, OSError):
    """A save failed (unwritable directory, disk full, ...); earlier checkpoints are intact."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes are damaged or missing: an array file fails to read, metadata is gone, or a
    restored leaf differs from the checksum written at save time."""
