"""Damaging a stored value on disk, for tests of corrupt-entry handling."""

from pathlib import Path


def flip_stored_byte(store, key: bytes, data_file: Path) -> None:
    """Flip one byte near the end of ``key``'s value in ``data_file`` (the store's ``data.mdb``)."""
    with store.read_session() as session:
        extent = session.locate(key)
    with open(data_file, "r+b") as f:
        f.seek(extent.offset + extent.length - 100)
        byte = f.read(1)
        f.seek(extent.offset + extent.length - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
