"""Defaults shared by the store and its callers, in a module that imports nothing (so command
lines can name them in ``--help`` without loading torch)."""

#: Tokens per chunk unless a layout says otherwise: 256, as LMCache's default ``chunk_size``. A
#: multiple of every engine block size in use (16, 32, 64, 128, 256).
DEFAULT_CHUNK_SIZE = 256

#: Disk tier capacity when a disk path is given without one (``kvstore serve --disk-path``,
#: the connectors' ``disk_path``): 4 GiB.
DEFAULT_DISK_BYTES = "4GiB"
