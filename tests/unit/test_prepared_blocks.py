"""framework.data.prepared in one process: what TokenBlocks reads back is the files' tokens, one
file after the other, cut into blocks (empty files included: they add nothing)."""

from __future__ import annotations

import torch

from framework.data.prepared import TokenBlocks, byte_tokens, fingerprint, prepare, text_files


def test_blocks_are_the_files_bytes_in_order_and_an_empty_file_adds_nothing(tmp_path):
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "a.txt").write_bytes(bytes(range(200)))
    (source / "pkg" / "__init__.py").write_bytes(b"")
    (source / "pkg" / "b.txt").write_bytes(b"hello world " * 30)
    files = text_files(source, "task.data.source")
    assert [f.name for f in files] == ["a.txt", "__init__.py", "b.txt"]
    manifest = {"input": fingerprint(files), "source": str(source), "encoder": "bytes"}
    out = tmp_path / "out"
    assert prepare([str(f) for f in files], byte_tokens, out, 1, manifest, chunk_bytes=10_000)
    stream = b"".join(f.read_bytes() for f in files)
    blocks = TokenBlocks(out, 16)
    assert len(blocks) == len(stream) // 16
    got = torch.cat([blocks[i] for i in range(len(blocks))])
    assert bytes(got.tolist()) == stream[: len(blocks) * 16]
    assert not prepare([str(f) for f in files], byte_tokens, out, 1, manifest), "already done"
