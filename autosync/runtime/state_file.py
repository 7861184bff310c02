"""A checkpoint's ``state.npz`` read an array at a time (``StateFile``), large arrays as memory maps
of the file's bytes (``mapped_member``) instead of private copies."""
from __future__ import annotations

import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from strategy_space.errors import ConfigError

MAP_BYTES = 1 << 20   # a state array this large or larger is read as a memory map (``StateFile``)
CRC_BLOCK = 64 << 20   # the bytes a mapped array's CRC check reads at a time


class StateFile(Mapping):
    """A ``state.npz`` as a read-only mapping that reads an array when it is asked for (a restore
    holds one parameter server's state at a time, not the whole file). Close it when done.

    An array of ``MAP_BYTES`` or more is not read into memory: it is a read-only memory map of its
    bytes in the file (a checkpoint stores its members uncompressed), checked against the archive's
    CRC first. So a restore holds the file's pages in the page cache, which the kernel may drop,
    instead of a private copy of each array (a re-cut restore copies out only the region a new
    shard takes: ``reshard``).

    Raises (on opening and on each read):
        ConfigError: the file cannot be read (the checkpoint is damaged).
    """

    def __init__(self, path: Path):
        self.path = path
        self._verified: set[str] = set()   # mapped members whose CRC matched (a re-cut reads one often)
        self._npz = self._read(lambda: np.load(path, allow_pickle=False))
        if not isinstance(self._npz, np.lib.npyio.NpzFile):
            raise ConfigError(f"restore: {path} is not an .npz archive; the checkpoint is damaged")

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._npz.files:
            raise KeyError(name)
        info = self._npz.zip.getinfo(f"{name}.npy")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size >= MAP_BYTES:
            array = self._read(lambda: mapped_member(self.path, info, name not in self._verified))
            self._verified.add(name)
            return array
        return self._read(lambda: self._npz[name])

    def __iter__(self):
        return iter(self._npz.files)

    def __len__(self) -> int:
        return len(self._npz.files)

    def close(self) -> None:
        self._npz.close()

    def _read(self, read):
        try:
            return read()
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise ConfigError(f"restore: {self.path} cannot be read ({e}); the checkpoint is damaged") from None


def mapped_member(path: Path, info: zipfile.ZipInfo, verify: bool = True) -> np.ndarray:
    """The array of an uncompressed ``.npy`` member of the archive at ``path`` as a read-only memory
    map, once its bytes match the member's CRC (with ``verify``; without, they did before).

    Raises:
        ValueError: the member is not a whole ``.npy`` of plain values, or its CRC differs.
    """
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)   # the member's local header: its name and extra field come next
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise ValueError(f"no local header for {info.filename} at byte {info.header_offset}")
        names = int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
        start = info.header_offset + 30 + names
        f.seek(start)
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"{info.filename} is a .npy of version {version}, which this reader does not map")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
    if dtype.hasobject or offset - start + int(np.prod(shape)) * dtype.itemsize != info.file_size:
        raise ValueError(f"{info.filename} is not a whole array of {dtype} {shape}")
    if verify and crc(np.memmap(path, np.uint8, mode="r", offset=start, shape=(info.file_size,))) != info.CRC:
        raise ValueError(f"{info.filename}: its bytes do not match the archive's CRC")
    mapped = np.memmap(path, dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
    return mapped.view(np.ndarray)


def crc(raw: np.ndarray) -> int:
    """The CRC-32 of a byte array, ``CRC_BLOCK`` bytes at a time."""
    value = 0
    for lo in range(0, len(raw), CRC_BLOCK):
        value = zlib.crc32(raw[lo:lo + CRC_BLOCK], value)
    return value
