"""Pack a device session's results into OUT so that they come back through the `device` tool, whose limits are
8 files, 16 MiB each, 64 MiB together, named in letters, digits, '.', '_' and '-'.

    python3 scripts/device_pack.py WORK OUT PATTERN...

WORK/logs goes whole into OUT/logs.tgz. Then the PATTERNs (globs relative to WORK, most wanted first; a folder
counts whole) are taken in order while the tar of what was taken fits the bytes and files left, and that tar is
written as OUT/res.part.00, .01, ... (15 MiB each; here: ``cat res.part.* > res.tar && tar -xf res.tar``). What did
not fit is named on the last line printed. scripts/device_session.sh calls this after every step, so a call cut at
the tool's limit still returns what the finished steps made. Old res.part.* and logs.tgz in OUT are replaced.
GRAFT_BLOCK_PACK_PART_BYTES / _TOTAL_BYTES / _FILES override 15 MiB / 62 MiB / 8 (tests shrink them).
"""
import glob
import os
import sys
import tarfile
from pathlib import Path

MIB = 1 << 20
PART = int(os.environ.get("GRAFT_BLOCK_PACK_PART_BYTES", 15 * MIB))
TOTAL = int(os.environ.get("GRAFT_BLOCK_PACK_TOTAL_BYTES", 62 * MIB))  # 2 MiB under the tool's 64 MiB
FILES = int(os.environ.get("GRAFT_BLOCK_PACK_FILES", 8))


def _entries(path: Path):
    yield path
    if path.is_dir():
        yield from sorted(path.rglob("*"))


def tar_bytes(path: Path) -> int:
    """An upper bound on what ``path`` adds to a tar: a 512-byte header (two for a long name) per entry, and each
    file's data rounded up to 512 bytes."""
    n = 0
    for p in _entries(path):
        n += 1024 if len(str(p)) > 99 else 512
        if p.is_file() and not p.is_symlink():
            n += -(-p.stat().st_size // 512) * 512
    return n


def pack(work: str, out: str, patterns: list[str]) -> tuple[list[str], list[str]]:
    work_p, out_p = Path(work), Path(out)
    out_p.mkdir(parents=True, exist_ok=True)
    for old in [*out_p.glob("res.part.*"), out_p / "logs.tgz"]:
        old.unlink(missing_ok=True)
    if (work_p / "logs").is_dir():
        with tarfile.open(out_p / "logs.tgz", "w:gz") as tf:
            tf.add(work_p / "logs", arcname="logs")
    others = [p for p in out_p.rglob("*") if p.is_file()]  # logs.tgz and anything else already there
    bytes_left = TOTAL - sum(p.stat().st_size for p in others)
    files_left = FILES - len(others)
    taken, left, seen, size = [], [], set(), 10240  # the tar's end blocks and record padding
    for pattern in patterns:
        for match in sorted(glob.glob(pattern, root_dir=work)):
            if match in seen:
                continue
            seen.add(match)
            add = tar_bytes(work_p / match)
            if size + add <= bytes_left and -(-(size + add) // PART) <= files_left:
                taken.append(match)
                size += add
            else:
                left.append(match)
    if taken:
        tmp = work_p / "res.tar"
        with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tf:
            for match in taken:
                tf.add(work_p / match, arcname=match)
        with open(tmp, "rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(PART), b"")):
                (out_p / f"res.part.{i:02d}").write_bytes(chunk)
        tmp.unlink()
    return taken, left


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.exit("usage: device_pack.py WORK OUT PATTERN...")
    taken, left = pack(argv[0], argv[1], argv[2:])
    parts = sorted(p.name for p in Path(argv[1]).glob("res.part.*"))
    print(f"[pack] {len(taken)} result paths in {len(parts)} res.part files: {' '.join(taken) or '-'}")
    print(f"[pack] left behind (over the tool's return limits): {' '.join(left) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
