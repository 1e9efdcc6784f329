"""The GGUF header reader that runs before conversion (:mod:`specdec.models.gguf_blocks`) on damaged
or hostile files: counts past the file, deep nesting, data past the end.  Each gives the outcome the
function gives for a damaged header (a ValueError, False, a one-line ConfigError), never a crash,
and reads at most what the file holds."""

from __future__ import annotations

import struct

import pytest

from specdec.errors import ConfigError
from specdec.models.gguf_blocks import _read_header, check_block_count, gguf_architecture, read_q4_blocks, ships_q4


def _s(text: bytes) -> bytes:  # a GGUF string: length, bytes
    return struct.pack("<Q", len(text)) + text


def _gguf(records: bytes, *, n_kv: int, n_tensors: int = 0, tensors: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + records + tensors


ARCH = _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama")


def _nested(depth: int) -> bytes:
    """A key whose value is arrays of arrays ``depth`` deep, the innermost holding one uint32."""
    body = struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    for _ in range(depth - 1):
        body = struct.pack("<IQ", 9, 1) + body
    return _s(b"x") + struct.pack("<I", 9) + body


#: a string whose length runs far past any file (and past a C ssize_t once added to the position)
HUGE = struct.pack("<Q", 2**64 - 1)


DAMAGED = [
    ("n_kv_huge", _gguf(ARCH + _s(b"k") + struct.pack("<I", 8) + HUGE + b"\0" * 64, n_kv=2**63)),
    ("n_tensors_huge", _gguf(ARCH, n_kv=1, n_tensors=2**63, tensors=HUGE + b"\0" * 64)),
    ("string_past_the_end", _gguf(HUGE + b"abc", n_kv=1)),
    ("strings_past_the_end", _gguf(ARCH + _s(b"v") + struct.pack("<IIQ", 9, 8, 2**63) + HUGE + b"\0" * 80, n_kv=2)),
    ("scalars_past_the_end", _gguf(ARCH + _s(b"v") + struct.pack("<IIQ", 9, 4, 2**61) + b"\0" * 80, n_kv=2)),
    ("nested_deep", _gguf(ARCH + _nested(100_000), n_kv=2)),
    ("nested_two_deep", _gguf(ARCH + _nested(3), n_kv=2)),
    ("alignment_negative", _gguf(ARCH + _s(b"general.alignment") + struct.pack("<Ii", 5, -32), n_kv=2)),
    ("alignment_zero", _gguf(ARCH + _s(b"general.alignment") + struct.pack("<II", 4, 0), n_kv=2)),
]


@pytest.mark.parametrize("name, data", DAMAGED, ids=[name for name, _ in DAMAGED])
def test_a_damaged_header_is_refused_cleanly(tmp_path, name, data):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_architecture(path)
    assert ships_q4(str(path)) is False


def test_arrays_one_deep_are_read(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf(_nested(2) + ARCH, n_kv=2))
    assert gguf_architecture(path) == "llama"


def test_blocks_past_the_end_of_the_file_are_a_one_line_config_error(tmp_path):
    """A Q4_1 layer matrix whose data the file does not hold (truncated): the reader used to fail
    in numpy / torch (``RuntimeError``) with a traceback."""
    tensor = _s(b"blk.0.ffn_up.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 64, 4) + struct.pack("<IQ", 3, 0)
    header = _gguf(ARCH, n_kv=1, n_tensors=1, tensors=tensor)
    pad = -len(header) % 32
    whole = 4 * 2 * 20  # 4 rows of two 20-byte Q4_1 blocks
    path = tmp_path / "short.gguf"
    path.write_bytes(header + b"\0" * (pad + whole))
    assert set(read_q4_blocks(path, 4, 2)) == {"model.layers.0.mlp.up_proj.weight"}  # whole: read
    path.write_bytes(header + b"\0" * (pad + whole - 30))
    with pytest.raises(ConfigError, match="blocks of") as err:
        read_q4_blocks(path, 4, 2)
    assert "\n" not in str(err.value)


def _layers_gguf(declared: int, layers: int) -> bytes:
    """A GGUF header declaring ``declared`` layers (llama.block_count) whose tensor table holds
    one matrix in each of ``layers`` layers."""
    count = _s(b"llama.block_count") + struct.pack("<II", 4, declared)
    tensors = b"".join(_s(f"blk.{i}.ffn_up.weight".encode()) + struct.pack("<IQQIQ", 2, 64, 4, 0, 0)
                       for i in range(layers))
    return _gguf(ARCH + count, n_kv=2, n_tensors=layers, tensors=tensors)


@pytest.mark.parametrize("declared, layers", [(1, 2), (3, 2)], ids=["layers_past_the_count", "last_layer_missing"])
def test_a_gguf_whose_layers_disagree_with_its_block_count_is_refused_before_conversion(tmp_path, declared, layers):
    """A lowered ``block_count`` made the float32 conversion (transformers) drop the layers past it
    and run another model in silence; a raised one, a model missing its last layer."""
    from specdec.models.registry import convert_gguf

    path = tmp_path / "edited.gguf"
    path.write_bytes(_layers_gguf(2, 2))
    check_block_count(path)  # as written: no complaint
    path.write_bytes(_layers_gguf(declared, layers))
    says = f"llama.block_count declares {declared} layers but the file holds layers 0..{layers - 1}"
    with pytest.raises(ConfigError, match=says):
        check_block_count(path)
    with pytest.raises(ConfigError, match=says):  # refused before the converter reads the file
        convert_gguf(path, tmp_path / "converted")
    assert not list(tmp_path.glob("converted*"))


def test_a_matrix_whose_rows_are_not_whole_blocks_is_a_one_line_config_error(tmp_path):
    """A Q4_1 matrix of 48 inputs a row (one and a half 32-input blocks), the file holding all its
    bytes: refused, not read as one block a row with the rest of each row taken for the next."""
    def file(k: int) -> bytes:
        tensor = _s(b"blk.0.ffn_up.weight") + struct.pack("<I", 2) + struct.pack("<QQ", k, 4) + struct.pack("<IQ", 3, 0)
        header = _gguf(ARCH, n_kv=1, n_tensors=1, tensors=tensor)
        return header + b"\0" * (-len(header) % 32 + 4 * 2 * 20)  # room for 4 rows of two Q4_1 blocks

    path = tmp_path / "odd.gguf"
    path.write_bytes(file(64))
    assert read_q4_blocks(path, 4, 2)["model.layers.0.mlp.up_proj.weight"].qs.shape[:2] == (4, 2)  # whole blocks: read
    path.write_bytes(file(48))
    with pytest.raises(ConfigError, match="does not fit whole blocks") as err:
        read_q4_blocks(path, 4, 2)
    assert "\n" not in str(err.value)


def test_a_header_whose_last_string_ends_at_the_end_of_the_file_is_read(tmp_path):
    """Nothing after the architecture string: every byte the header needs is there."""
    path = tmp_path / "bare.gguf"
    path.write_bytes(_gguf(ARCH, n_kv=1))
    assert gguf_architecture(path) == "llama"


def test_an_alignment_written_as_a_bool_is_a_damaged_header(tmp_path):
    """GGUF value type 7 is a bool: ``true`` is not an alignment of 1."""
    path = tmp_path / "bool.gguf"
    path.write_bytes(_gguf(ARCH + _s(b"general.alignment") + struct.pack("<IB", 7, 1), n_kv=2))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_architecture(path)


def test_the_block_count_check_leaves_files_it_cannot_judge_to_the_converter(tmp_path):
    """No layer tensors at all (nothing to compare), or no file: no complaint here (the
    converter reports what is wrong), and never a bare ValueError / OSError."""

    path = tmp_path / "nolayers.gguf"
    path.write_bytes(_gguf(ARCH + _s(b"llama.block_count") + struct.pack("<II", 4, 2), n_kv=2))
    assert check_block_count(path) is None
    assert check_block_count(tmp_path / "missing.gguf") is None


def test_ships_q4_at_exactly_half_and_not_without_layer_matrices(tmp_path):
    """"Mostly" 4-bit includes exactly half the layer weights; a GGUF with no layer matrix at all
    (only an embedding) does not ship 4-bit layers."""
    import numpy as np

    from tests.models.test_q4 import _write_gguf

    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    half = tmp_path / "half.gguf"
    _write_gguf(half, {"blk.0.ffn_up.weight": (w, "Q4_0"), "blk.0.ffn_gate.weight": (w, "F32")})
    assert ships_q4(str(half))
    none = tmp_path / "none.gguf"
    _write_gguf(none, {"token_embd.weight": (w, "Q4_0")})
    assert not ships_q4(str(none))


def test_the_lm_head_is_returned_only_with_q6(tmp_path):
    """An untied ``output.weight`` in 4-bit blocks comes back as ``lm_head.weight`` only when
    ``q6`` is asked for (without it the loader builds the head as before)."""
    import numpy as np

    from tests.models.test_q4 import _write_gguf

    rng = np.random.default_rng(5)
    path = tmp_path / "head.gguf"
    _write_gguf(path, {"blk.0.ffn_up.weight": (rng.standard_normal((64, 96)).astype(np.float32), "Q4_0"),
                       "output.weight": (rng.standard_normal((128, 96)).astype(np.float32), "Q4_0")})
    assert set(read_q4_blocks(path, 4, 2)) == {"model.layers.0.mlp.up_proj.weight"}
    assert set(read_q4_blocks(path, 4, 2, q6=True)) == {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}


def test_ships_q4_counts_q4_k_layers_and_ignores_biases(tmp_path):
    """Q4_K layer matrices are 4-bit as shipped; a layer's bias (``blk.N.attn_q.bias``) is not
    a layer matrix and does not tip a file that is exactly half 4-bit."""
    import numpy as np

    from tests.models.test_q4 import _q4_k_raw, _write_gguf, _write_raw_gguf

    rng = np.random.default_rng(6)
    q4k = tmp_path / "q4k.gguf"
    _write_raw_gguf(q4k, {"blk.0.ffn_up.weight": (_q4_k_raw(rng, 64, 256, True), "Q4_K")}, "qwen2")
    assert ships_q4(str(q4k))
    w = rng.standard_normal((64, 96)).astype(np.float32)
    biased = tmp_path / "biased.gguf"
    _write_gguf(biased, {"blk.0.ffn_up.weight": (w, "Q4_0"), "blk.0.ffn_gate.weight": (w, "F32"),
                         "blk.0.attn_q.bias": (rng.standard_normal(64).astype(np.float32), "F32")})
    assert ships_q4(str(biased))


def _gguf_with_layers(declared: int, layers: list[int]) -> bytes:
    count = _s(b"llama.block_count") + struct.pack("<II", 4, declared)
    tensors = b"".join(_s(f"blk.{i}.ffn_up.weight".encode()) + struct.pack("<IQQIQ", 2, 64, 4, 0, 0) for i in layers)
    return _gguf(ARCH + count, n_kv=2, n_tensors=len(layers), tensors=tensors)


def test_a_gguf_missing_a_middle_layer_is_refused(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(_gguf_with_layers(4, [0, 1, 2, 3]))
    check_block_count(path)  # whole: no complaint
    path.write_bytes(_gguf_with_layers(4, [0, 1, 3]))
    with pytest.raises(ConfigError, match="llama.block_count declares 4 layers"):
        check_block_count(path)


def test_the_tensor_data_starts_where_the_gguf_reference_reader_puts_it(tmp_path):
    """Without a ``general.alignment`` key the data section starts at the next multiple of 32
    (GGUF's default): the reference reader in the ``gguf`` package agrees for tensor names
    of 1 to 64 characters in steps of 7, which move the header's end through two 32-byte steps."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    for n in range(1, 65, 7):
        path = tmp_path / f"name{n}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor("t" * n, np.arange(8, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        expected = gguf.GGUFReader(str(path)).tensors[0].data_offset
        assert _read_header(path).data_start == expected, n


def test_a_file_of_exactly_the_smallest_key_value_records_is_read(tmp_path):
    """Each key-value record takes at least 13 bytes (empty key, type, a uint8): 40 of them and
    nothing else is a valid header, not "more records than the file has room for"."""
    n = 40
    records = (_s(b"") + struct.pack("<IB", 0, 1)) * n
    path = tmp_path / "kv.gguf"
    path.write_bytes(_gguf(records, n_kv=n))
    assert _read_header(path).arch == ""


def test_a_string_array_of_empty_strings_ending_the_file_is_read(tmp_path):
    """Each string of an array takes at least 8 bytes: 40 empty ones ending the file fit exactly."""
    n = 40
    records = ARCH + _s(b"tokens") + struct.pack("<IIQ", 9, 8, n) + struct.pack("<Q", 0) * n
    path = tmp_path / "strings.gguf"
    path.write_bytes(_gguf(records, n_kv=2))
    assert gguf_architecture(path) == "llama"


def test_an_array_of_empty_arrays_ending_the_file_is_read(tmp_path):
    """Each inner array takes at least 12 bytes (type, count): 40 empty ones ending the file fit."""
    n = 40
    records = ARCH + _s(b"nested") + struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 4, 0) * n
    path = tmp_path / "arrays.gguf"
    path.write_bytes(_gguf(records, n_kv=2))
    assert gguf_architecture(path) == "llama"


def test_a_block_count_written_as_a_bool_is_left_to_the_converter(tmp_path):
    """``llama.block_count`` of GGUF type bool (7) is not a layer count: with two layers held,
    the check does not complain (True is not "1 layer")."""
    tensors = b"".join(_s(f"blk.{i}.ffn_up.weight".encode()) + struct.pack("<IQ", 1, 32) + struct.pack("<IQ", 0, 0)
                       for i in range(2))
    records = ARCH + _s(b"llama.block_count") + struct.pack("<IB", 7, 1)
    path = tmp_path / "boolcount.gguf"
    path.write_bytes(_gguf(records, n_kv=2, n_tensors=2, tensors=tensors))
    assert [t[0] for t in _read_header(path).tensors] == ["blk.0.ffn_up.weight", "blk.1.ffn_up.weight"]
    assert check_block_count(path) is None


def test_a_blk_tensor_without_a_layer_number_is_not_a_layer(tmp_path):
    """``blk.x.ffn_up.weight`` (no number) is not counted as a layer: the check compares the
    numbered ones (0 and 1) with a declared count of 2 and says nothing, never a bare ValueError."""
    names = ["blk.0.ffn_up.weight", "blk.1.ffn_up.weight", "blk.x.ffn_up.weight"]
    tensors = b"".join(_s(n.encode()) + struct.pack("<IQ", 1, 32) + struct.pack("<IQ", 0, 0) for n in names)
    records = ARCH + _s(b"llama.block_count") + struct.pack("<II", 4, 2)
    path = tmp_path / "named.gguf"
    path.write_bytes(_gguf(records, n_kv=2, n_tensors=3, tensors=tensors))
    assert check_block_count(path) is None
