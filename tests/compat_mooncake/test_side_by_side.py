"""The Mooncake drop-in beside the real Mooncake: scenarios of every form (sessions,
tensors, tensor parallelism, multi-buffer values, metadata, segments, replicas, tasks)
whose answers are checked here and, where Mooncake is installed, compared with Mooncake
0.3.13's answer for answer (skipped when it is not)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from beluga.compat import mooncake as compat
from beluga.compat.mooncake import MooncakeDistributedStore
from beluga.pool import Pool
from tests.compat_mooncake.conftest import buffer_of, connect

# -- side by side with the real Mooncake --------------------------------------------------


def scenario(s: Any) -> list[Any]:
    """One sequence of calls and edge cases; returns every answer, for comparison."""
    buf, ptr = buffer_of(b"hello zero copy", 4096)
    small, small_ptr = buffer_of(b"", 8)
    answers: list[Any] = [
        s.put("a", b"first"),
        s.put("a", b"second"),
        s.get("a"),
        s.upsert("a", b"third!"),
        s.get("a"),
        s.get_size("a"),
        s.get("nope"),
        s.get_size("nope"),
        s.is_exist("a"),
        s.is_exist("nope"),
        s.batch_is_exist(["a", "nope", ""]),
        s.put("empty", b""),
        s.put("", b"x"),
        s.get(""),
        s.register_buffer(ptr, 4096),
        s.register_buffer(ptr, 4096),
        s.register_buffer(small_ptr, 8),
        s.put_from("z", ptr, 15),
        s.get_into("z", ptr + 100, 200),
        bytes(buf[100:115]),
        s.get_into("z", small_ptr, 8),
        s.get_into("nope", ptr, 100),
        s.batch_put_from(["b1", "b2", "z"], [ptr, ptr + 16, ptr], [10, 10, 15]),
        s.batch_put_from(["m1", "m2"], [ptr, ptr, ptr], [1, 1, 1]),
        s.batch_get_into(
            ["b1", "nope", "z", "b2"],
            [ptr + 1000, ptr + 2000, small_ptr, ptr + 3000],
            [100] * 2 + [8, 100],
        ),
        s.batch_get_into(["b1", "b2"], [ptr, ptr, ptr], [100, 100, 100]),
        s.unregister_buffer(ptr),
        s.unregister_buffer(ptr),
        s.unregister_buffer(small_ptr),
        s.put_batch(["p1", "p2"], [b"one", b"two"]),
        s.put_batch(["p3", "p4"], [b"one"]),
        s.put_batch(["p1", "p5"], [b"ONE", b"five"]),
        s.get_batch(["p1", "nope", "p5"]),
        s.upsert_batch(["p1", "p6"], [b"uno", b"six"]),
        s.get_batch(["p1", "p6"]),
        s.put_parts("pp", b"ab", b"cd"),
        s.upsert_parts("pp", b"x", b"yz"),
        s.get("pp"),
        [None if h is None else bytes(h) for h in s.batch_get_buffer(["p1", "nope"])],
        s.put_tensor("t", torch.arange(6.0).reshape(2, 3)),
        s.get_tensor("t").tolist(),
        s.upsert_tensor("t", torch.ones(2, dtype=torch.bfloat16)),
        s.get_tensor("t").tolist(),
        s.get_tensor("nope"),
        s.get_tensor("p1"),
        s.put_tensor("t2", b"abc"),
        s.remove("nope"),
        s.health_check(),
    ]
    del small
    return answers


def scenario_more(s: Any, module: Any) -> list[Any]:
    """Soft pins, ranged reads, tensor-parallel forms and replica clearing; every answer.

    ``module`` is the one ``s`` comes from (its ``ReplicateConfig``, ``SoftPinAction``).
    """
    ReplicateConfig, SoftPinAction = module.ReplicateConfig, module.SoftPinAction

    data1, data2 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz0123"
    buf, ptr = buffer_of(b"", 64)
    enable, preserve, disable = ReplicateConfig(), ReplicateConfig(), ReplicateConfig()
    enable.soft_pin_action, enable.soft_pin_ttl_ms = SoftPinAction.ENABLE, 1000
    preserve.soft_pin_ttl_ms = 1000
    disable.soft_pin_action = SoftPinAction.DISABLE
    tensor = torch.arange(24.0).reshape(2, 4, 3)
    answers: list[Any] = [
        preserve.soft_pin_ttl_ms,
        ReplicateConfig().soft_pin_ttl_ms,
        int(ReplicateConfig().soft_pin_action),
        s.put("sp", b"pinned", enable),
        s.upsert("sp", b"pinned", preserve),
        s.upsert("sp", b"again", disable),
        s.get("sp"),
        s.put("r1", data1),
        s.put("r2", data2),
        s.register_buffer(ptr, 64),
        s.get_into_ranges(
            [ptr],
            [["r1", "r2", "nope"]],
            [[[0, 20], [8], [40]]],
            [[[1, 30], [2], [0]]],
            [[[4, 3], [5], [4]]],
        ),
        bytes(buf[0:4]) + bytes(buf[8:13]) + bytes(buf[20:23]),
        s.get_into_ranges([ptr], [["r1"]], [[[0]]], [[[len(data1) - 1]]], [[[4]]])[0][0][0] < 0,
        s.get_into_ranges([ptr], [["r1"]], [[[63]]], [[[0]]], [[[4]]])[0][0][0] < 0,
        s.unregister_buffer(ptr),
        s.put_tensor_with_tp("tp", tensor, tp_size=2, split_dim=1),
        [s.get_tensor_with_tp("tp", tp_rank=r, tp_size=2).tolist() for r in range(2)],
        s.batch_put_tensor_with_tp(["btp"], [tensor], tp_size=2, split_dim=2),
        [
            getattr(t, "shape", None)
            for t in s.batch_get_tensor_with_tp(["btp"], tp_rank=1, tp_size=2)
        ],
        s.put_tensor_with_tp("one", tensor),
        getattr(s.get_tensor_with_tp("one"), "shape", None),
        getattr(s.get_tensor("one"), "shape", None),
        s.batch_replica_clear([]),
        s.batch_replica_clear(["nope1", "nope2"]),
        s.batch_replica_clear(["r1", "r2"]),  # leased: just written and read
        s.get("r1") == data1,
        ":" in s.get_hostname(),
        s.batch_put_tensor_with_tp(["even"], [tensor], tp_size=2, split_dim=0),
    ]
    return answers


def scenario_tensors(s: Any, module: Any) -> list[Any]:
    """The pub, *_from, tensor-parallel *_from / *_into, whole-tensor *_with_parallelism and
    multi-buffer forms; every answer (tensors as lists, so both systems' answers compare)."""

    def listed(t: Any) -> Any:
        return None if t is None else t.tolist()

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _buf, ptr = buffer_of(b"", 4096)
    _out, out_ptr = buffer_of(b"", 4096)
    parts = [buffer_of(b"head-"), buffer_of(b"middle--"), buffer_of(b"tail")]
    into = [buffer_of(b"", n) for n in (5, 8, 4)]
    bufs = [(ptr, 4096), (out_ptr, 4096)] + [(a, len(b)) for b, a in parts + into]
    registered = [s.register_buffer(a, n) for a, n in bufs]
    answers: list[Any] = [registered, s.pub_tensor("pt", t + 1), listed(s.get_tensor("pt"))]
    answers += [s.pub_tensor("pt", t), s.upsert_pub_tensor("pt", t), listed(s.get_tensor("pt"))]
    answers += [
        s.batch_pub_tensor(["bp0", "bp1"], [t, t + 1]),
        [listed(x) for x in s.batch_get_tensor(["bp0", "bp1"])],
        s.batch_upsert_pub_tensor(["bp0"], [t + 5]),
        listed(s.get_tensor("bp0")),
        s.pub_tensor_with_tp("ptp", t, module.ReplicateConfig(), tp_size=2, split_dim=1),
        [listed(s.get_tensor_with_tp("ptp", tp_rank=r, tp_size=2)) for r in range(2)],
        s.batch_pub_tensor_with_tp(["bptp"], [t], tp_size=3, split_dim=0),
        listed(s.get_tensor_with_tp("bptp", tp_rank=2, tp_size=3)),
    ]
    n = s.get_size("pt")
    answers += [listed(s.get_tensor_into("pt", ptr, 4096))]
    answers += [
        s.put_tensor_from("ptf", ptr, n),
        s.batch_put_tensor_from(["bf0", "bf1"], [ptr, ptr], [n, n]),
        [listed(x) for x in s.batch_get_tensor(["ptf", "bf0", "bf1"])],
        s.upsert_tensor_from("bf0", ptr, n),
        s.batch_upsert_tensor_from(["bf1", "bf2"], [ptr, ptr], [n, n]),
        listed(s.get_tensor("bf2")),
        s.put_tensor_with_tp_from("tpf", ptr, n, tp_size=2, split_dim=1),
        [listed(s.get_tensor_with_tp("tpf", tp_rank=r, tp_size=2)) for r in range(2)],
        s.batch_put_tensor_with_tp_from(["btpf"], [ptr], [n], tp_size=2, split_dim=0),
        listed(s.get_tensor_with_tp_into("btpf", out_ptr, 4096, tp_rank=1, tp_size=2)),
        [listed(x) for x in s.batch_get_tensor_with_tp_into(["tpf"], [out_ptr], [4096], 0, 2)],
        s.put_tensor_with_parallelism("par", t),
        listed(s.get_tensor_with_parallelism("par")),
        s.put_tensor_with_parallelism("par", t + 1),
        s.upsert_tensor_with_parallelism("par", t + 1),
        listed(s.get_tensor("par")),
        s.batch_put_tensor_with_parallelism(["pb0", "pb1"], [t, t + 1]),
        s.batch_upsert_tensor_with_parallelism(["pb1"], [t + 2]),
        [listed(x) for x in s.batch_get_tensor_with_parallelism(["pb0", "pb1", "nope"])],
        s.put_tensor_with_parallelism_from("pf", ptr, n),
        s.upsert_tensor_with_parallelism_from("pf", ptr, n),
        s.batch_put_tensor_with_parallelism_from(["pf1"], [ptr], [n]),
        s.batch_upsert_tensor_with_parallelism_from(["pf2"], [ptr], [n]),
        listed(s.get_tensor_with_parallelism_into("pf2", out_ptr, 4096)),
        [listed(x) for x in s.batch_get_tensor_with_parallelism_into(["pf1"], [out_ptr], [4096])],
        s.batch_put_from_multi_buffers(["mb"], [[a for _, a in parts]], [[5, 8, 4]]),
        s.get("mb"),
        s.batch_put_from_multi_buffers(["mb"], [[a for _, a in parts]], [[5, 8, 4]]),
        s.batch_get_into_multi_buffers(["mb"], [[a for _, a in into]], [[5, 8, 4]]),
        b"".join(bytes(b) for b, _ in into),
        s.batch_get_into_multi_buffers(["nope"], [[a for _, a in into]], [[5, 8, 4]])[0] < 0,
        s.batch_put_from_multi_buffers(["mb2", "mb3"], [[parts[0][1]]], [[5]]),
    ]
    answers += [[s.unregister_buffer(a) for a, _ in bufs]]
    return answers


def scenario_meta(s: Any, module: Any, folder: str) -> list[Any]:
    """Metadata-prefixed puts, safetensors files, and the segment, replica and task forms
    (no meaning on a pool: their codes and shapes must be Mooncake's); every answer."""
    _data, data_ptr = buffer_of(bytes(range(64)))
    _meta, meta_ptr = buffer_of(b"METADATA")
    t = torch.arange(6.0).reshape(2, 3)
    os.makedirs(folder, exist_ok=True)
    path = f"{folder}/t.safetensors"
    answers: list[Any] = [
        s.put_from_with_metadata("m", data_ptr, meta_ptr, 64, 8),
        s.get("m"),
        s.put_tensor("st", t),
        s.save_tensor_to_safetensor("st", path),
        s.save_tensor_to_safetensor("nope", f"{folder}/nope.safetensors"),
        s.load_tensor_from_safetensor("st2", path).tolist(),
        s.get_tensor("st2").tolist(),
        s.load_tensor_from_safetensor("st3", f"{folder}/missing.safetensors"),
        s.get_replica_desc("nope"),
        s.batch_get_replica_desc(["nope"]),
        [
            (r.is_memory_replica(), r.is_disk_replica(), int(r.status))
            for r in s.get_replica_desc("m")
        ],
        s.get_replica_desc("m")[0].get_memory_descriptor().buffer_descriptor.size,
        list(s.batch_get_replica_desc(["m", "nope"])),
        s.create_copy_task("nope", ["x"])[1],
        s.create_copy_task("m", ["x"])[1],
        s.create_move_task("m", "a", "b")[1],
        s.query_task((1, 2)),
        s.unmount_segment(["bogus"]),
        s.mount_segment(f"{folder}/no-such-file", 16 << 20),
        sorted(s.allocate_and_mount_segment(16 << 20).items())[0],
        s.allocate_and_mount_segment(16 << 20)["allocated_size"],
        s.unmount_local_disk_segment(),
        s.get_offload_rpc_read_count(),
    ]
    with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
        s.get_replica_desc("m")[0].get_disk_descriptor()
    return answers


def scenario_sessions(s: Any) -> list[Any]:
    """Put sessions assembling objects from ranges, get sessions reading ranges; every
    answer."""
    pieces = [buffer_of(b"0123456789"), buffer_of(b"abcdef"), buffer_of(b"XYZ")]
    ptr = [a for _, a in pieces]
    out = [buffer_of(b"", 4), buffer_of(b"", 6)]
    out_ptr = [a for _, a in out]
    bufs = [(a, len(b)) for b, a in pieces + out]
    answers: list[Any] = [[s.register_buffer(a, n) for a, n in bufs]]
    answers += [
        s.batch_put_session_start(["ps1", "ps2"], [16, 3]),
        s.batch_put_session_start(["ps1"], [16]),  # open already
        s.get("ps1"),  # not readable before the end
        s.batch_put_from_multi_buffer_ranges(["ps1"], [[ptr[1], ptr[0]]], [[6, 10]], [[10, 0]]),
        s.batch_put_from_multi_buffer_ranges(["ps2"], [[ptr[2]]], [[3]], [[1]]),  # past the end
        s.batch_put_from_multi_buffer_ranges(["nope"], [[ptr[2]]], [[3]], [[0]]),
        s.batch_put_from_multi_buffer_ranges(["ps2"], [[ptr[2]]], [[3]], [[0]]),
        s.batch_put_session_end(["ps1", "ps2", "nope"]),
        s.get("ps1"),
        s.get("ps2"),
        s.batch_put_session_start(["ps3"], [4]),
        s.batch_put_session_revoke(["ps3", "nope"]),
        s.get("ps3"),
        s.batch_get_session_start([]),
        s.batch_get_session_start(["ps1", "nope"]),
        s.batch_get_into_multi_buffer_ranges(
            ["ps1", "ps2"], [out_ptr, [out_ptr[0]]], [[4, 6], [3]], [[2, 10], [0]]
        ),
        bytes(out[0][0]) + bytes(out[1][0]),
        s.batch_get_into_multi_buffer_ranges(["ps1"], [[out_ptr[0]]], [[4]], [[14]]),
        s.batch_get_session_end(["ps1"]),
        s.batch_get_into_multi_buffer_ranges(["ps1"], [[out_ptr[0]]], [[4]], [[0]]),
    ]
    answers += [[s.unregister_buffer(a) for a, _ in bufs]]
    return answers


def test_sessions_assemble_objects_from_ranges_and_read_ranges(
    store: MooncakeDistributedStore,
) -> None:
    """Beluga's own answers to scenario_sessions (compared with Mooncake's side by side)."""
    a = scenario_sessions(store)
    assert a[1] == [0, 0] and a[2] == [-600] and a[3] == b""  # unreadable until the end
    assert a[4] == [16] and a[5] == [-600] and a[6] == [-600] and a[7] == [3]
    assert a[8] == [0, 0, -600] and a[9] == b"0123456789abcdef" and a[10] == b"XYZ"
    assert a[12] == [0, -600] and a[13] == b""  # revoked: nothing stored
    assert a[15] == [0, -704] and a[16] == [10, -600]  # ps2 has no get session
    assert a[17] == b"2345abcdef" and a[18] == [-600] and a[19] == 0 and a[20] == [-600]


def test_metadata_files_segments_replicas_and_tasks(
    store: MooncakeDistributedStore, tmp_path: Path
) -> None:
    """Beluga's own answers to scenario_meta (compared with Mooncake's side by side)."""
    a = scenario_meta(store, compat, str(tmp_path))
    assert a[0] == 0 and a[1] == b"METADATA" + bytes(range(64))  # metadata first, then data
    assert a[3] == 0 and a[4] == compat.FILE_NOT_FOUND and a[5] == a[6] == [[0, 1, 2], [3, 4, 5]]
    assert a[7] is None and a[8] == [] and a[9] == {}
    assert a[10] == [(True, False, 3)] and a[11] == 72 and a[12] == ["m"]
    assert a[13] == -704 and a[14] == a[15] == -600 and a[16] == (None, -1400)
    assert a[17] == -1 and a[18] == {"ret": -1, "segment_ids": []}
    assert a[19] == ("allocated_size", 16 << 20) and a[21] == a[22] == 0


def test_tensor_and_multi_buffer_forms_round_trip(store: MooncakeDistributedStore) -> None:
    """Beluga's own answers to scenario_tensors (the side-by-side test compares them with
    Mooncake's where it is installed): what a user reads back is what was written."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    answers = scenario_tensors(store, compat)
    assert answers[0] == [0] * 8 and answers[2] == (t + 1).tolist()
    assert answers[-8] == [0] and answers[-7] == b"head-middle--tail"  # gathered, in order
    assert answers[-5] == [17] and answers[-4] == b"head-middle--tail"  # and scattered back
    assert answers[-3] is True and answers[-2] == [-600, -600]  # a miss; lists that differ
    assert answers[-1] == [0] * 8


def test_a_parallelism_request_is_refused_and_stores_nothing(
    store: MooncakeDistributedStore, caplog: pytest.LogCaptureFixture
) -> None:
    t = torch.ones(2, 2)
    request = object()  # a TensorParallelism / ReadTarget / writer_partition stand-in
    assert store.put_tensor_with_parallelism("p", t, parallelism=request) == -600
    assert store.batch_put_tensor_with_parallelism(["p"], [t], writer_partitions=[request]) == [
        -600
    ]
    assert store.is_exist("p") == 0
    assert store.put_tensor("p", t) == 0
    assert store.get_tensor_with_parallelism("p", target=request) is None
    assert "parallelism requests are not supported" in caplog.text


def test_multi_buffers_that_do_not_fit_the_value_are_refused(
    store: MooncakeDistributedStore,
) -> None:
    parts = [buffer_of(b"abc"), buffer_of(b"defg")]
    ptrs = [a for _, a in parts]
    assert store.batch_put_from_multi_buffers(["m"], [ptrs], [[3, 4]]) == [0]
    small, small_ptr = buffer_of(b"", 3)
    assert store.batch_get_into_multi_buffers(["m"], [[small_ptr]], [[3]]) == [-600]
    assert bytes(small) == b"\0\0\0"  # nothing written into a buffer the value does not fit
    assert store.batch_put_from_multi_buffers(["m", "n"], [ptrs], [[3, 4]]) == [-600, -600]
    assert store.batch_put_from_multi_buffers(["n"], [[ptrs[0], 0]], [[3, 4]]) == [-600]
    assert store.is_exist("n") == 0


def test_answers_match_mooncake_side_by_side(pool: Pool, tmp_path: Path) -> None:
    from beluga.bench.mooncake import MooncakeBaseline
    from beluga.errors import BackendUnavailableError
    from beluga.kv.tier.mooncake import check_available

    try:
        check_available()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    s = connect(pool)
    ours = (
        scenario(s),
        scenario_more(s, compat),
        scenario_tensors(s, compat),
        scenario_meta(s, compat, str(tmp_path / "ours")),
        scenario_sessions(s),
    )
    s.remove_all()
    s.close()
    with MooncakeBaseline(segment_size=64 << 20, local_buffer_size=16 << 20) as mc:
        # the baseline's raw mooncake.store client, set up on its private cluster
        theirs = (
            scenario(mc.client._store),
            scenario_more(mc.client._store, sys.modules[type(mc.client._store).__module__]),
            scenario_tensors(mc.client._store, sys.modules[type(mc.client._store).__module__]),
            scenario_meta(
                mc.client._store,
                sys.modules[type(mc.client._store).__module__],
                str(tmp_path / "theirs"),
            ),
            scenario_sessions(mc.client._store),
        )
        module = sys.modules[type(mc.client._store).__module__]
    assert module is not compat
    exported = [n for n in dir(module) if n.isupper() and hasattr(getattr(module, n), "__int__")]
    assert exported and all(int(getattr(compat, n)) == int(getattr(module, n)) for n in exported)
    assert ours[0] == theirs[0]
    differing = [i for i, (a, b) in enumerate(zip(ours[1], theirs[1], strict=True)) if a != b]
    assert ours[1] == theirs[1], f"answers {differing} differ: {ours[1]} vs {theirs[1]}"
    differing = [i for i, (a, b) in enumerate(zip(ours[4], theirs[4], strict=True)) if a != b]
    assert ours[4] == theirs[4], "session answers differ: " + "; ".join(
        f"{i}: {ours[4][i]} vs {theirs[4][i]}" for i in differing
    )
    differing = [i for i, (a, b) in enumerate(zip(ours[3], theirs[3], strict=True)) if a != b]
    assert ours[3] == theirs[3], "segment/replica/file answers differ: " + "; ".join(
        f"{i}: {ours[3][i]} vs {theirs[3][i]}" for i in differing
    )
    differing = [i for i, (a, b) in enumerate(zip(ours[2], theirs[2], strict=True)) if a != b]
    assert ours[2] == theirs[2], f"tensor answers {differing} differ: " + "; ".join(
        f"{i}: {ours[2][i]} vs {theirs[2][i]}" for i in differing
    )
