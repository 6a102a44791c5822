"""Host-side parts of the push collectives, on the CPU: error words, the poison latch, the epoch book, the layout
shared with the CUDA source, handle checks, capability refusals and the reference oracle's combine."""
from __future__ import annotations

import pickle
import re
import shutil
import subprocess

import pytest
import torch

from dspark_ray.model.collectives import CollectiveError
from dspark_ray.comm import peer_state
from dspark_ray.comm.ipc import HANDLE_VERSION, PeerHandle, check_peer_handle
from dspark_ray.comm.peer_state import (EPOCH_LAST, ERR_BAD_ID, ERR_CANCELLED, ERR_EXHAUSTED, ERR_LAYOUT,
                                           ERR_LOCAL_TIMEOUT, ERR_PEER_TIMEOUT, HostGuard, Layout,
                                           decode_error_word, describe_error_word)
from dspark_ray.comm.push import (DEFAULT_MAX_WORDS, PushCollectives, ar_launch_config, exchange_threads,
                                     push_unavailable_reason)
from dspark_ray.comm.reference import ReferenceCollectives, same_bits
from dspark_ray.comm.source import KERNELS, kernel_source


@pytest.fixture(autouse=True)
def clean_process_latch(monkeypatch):
    # the latch is process-wide by design; each test gets a fresh one
    monkeypatch.setattr(peer_state, "_PROCESS_POISON", [])


# --- error word ------------------------------------------------------------------------------------------------

def test_each_documented_error_bit_has_its_name():
    assert decode_error_word(ERR_LOCAL_TIMEOUT) == ["local timeout"]
    assert decode_error_word(ERR_PEER_TIMEOUT) == ["peer timeout"]
    assert decode_error_word(ERR_BAD_ID) == ["invalid received id"]
    assert decode_error_word(ERR_CANCELLED) == ["cancelled"]
    assert decode_error_word(ERR_EXHAUSTED) == ["epoch exhaustion"]
    assert decode_error_word(ERR_LAYOUT) == ["layout mismatch"]
    assert (ERR_LOCAL_TIMEOUT, ERR_PEER_TIMEOUT, ERR_BAD_ID, ERR_CANCELLED, ERR_EXHAUSTED) == (1, 2, 4, 8, 16)


def test_error_word_decodes_combinations_lowest_bit_first_and_names_unknown_bits():
    assert decode_error_word(0) == []
    assert decode_error_word(1 | 2 | 16) == ["local timeout", "peer timeout", "epoch exhaustion"]
    assert decode_error_word(0x80000008) == ["cancelled", "unknown bit 0x80000000"]
    assert describe_error_word(3) == "0x3 (local timeout | peer timeout)"
    assert describe_error_word(0) == "0x0 (none)"
    with pytest.raises(ValueError):
        decode_error_word(1 << 32)


# --- layout shared with push.cu --------------------------------------------------------------------------------

def test_layout_offsets_are_aligned_and_disjoint():
    lay = Layout(DEFAULT_MAX_WORDS)
    assert lay.OFF_FLAGS % 8 == 0 and lay.off_acks % 4 == 0
    assert lay.OFF_FLAGS + 2 * lay.maxb * 8 <= lay.off_acks
    assert lay.off_acks + 2 * lay.maxb * 4 <= lay.off_xrecv
    assert lay.off_xrecv % 16 == 0 and lay.off_xrecv + 2 * lay.maxx * 32 <= lay.off_recv
    assert lay.off_recv % 16 == 0
    assert lay.nbytes == lay.off_recv + 2 * DEFAULT_MAX_WORDS * 4
    assert Layout(5).words == 8          # rounded up to whole float4s
    assert max(lay.OFF_HELLO, lay.OFF_ERR_EPOCH) + 4 <= lay.OFF_FLAGS


def test_layout_refuses_sizes_the_flag_cannot_describe():
    with pytest.raises(CollectiveError, match="max_words"):
        Layout(1 << 20)
    with pytest.raises(CollectiveError, match="maxb"):
        Layout(1024, maxb=256)
    assert Layout(1024).digest() != Layout(2048).digest()
    assert Layout(1024).digest() == Layout(1024).digest()


def test_cuda_source_gets_every_layout_constant_and_its_fallbacks_match_the_default_layout():
    src = (peer_state.__file__.rsplit("/", 1)[0]) + "/push.cu"
    text = open(src).read()
    fallback = dict(re.findall(r"#define (PUSH_\w+|OFF_\w+) (\d+)", text.split("#endif", 1)[0]))
    lay = Layout(DEFAULT_MAX_WORDS)
    generated = dict(re.findall(r"#define (\w+) (\d+)", lay.cuda_defines()))
    assert set(fallback) == set(generated)
    assert fallback == generated, "push.cu's standalone defaults drifted from peer_state.Layout"
    full = kernel_source(lay)
    assert full.startswith(lay.cuda_defines())
    for k in KERNELS:
        assert f"void {k}(" in full or f"\n{k}(" in full


def test_lamport_empty_pattern_is_the_same_signaling_nan_on_both_sides():
    text = open(peer_state.__file__.rsplit("/", 1)[0] + "/push.cu").read()
    assert f"#define LAMPORT_EMPTY {peer_state.LAMPORT_EMPTY:#X}u".replace("0X", "0x") in text
    assert peer_state.LAMPORT_EMPTY & 0x7F800000 == 0x7F800000        # a NaN ...
    assert not peer_state.LAMPORT_EMPTY & 0x00400000                   # ... with the quiet bit clear


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_for_sm90(tmp_path):
    cu = tmp_path / "push_gen.cu"
    cu.write_text(kernel_source(Layout(DEFAULT_MAX_WORDS)))
    for relaxed in (0, 1):
        r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", f"-DPUSH_ACK_RELAXED={relaxed}", "-c", str(cu),
                            "-o", str(tmp_path / "p.o")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]


# --- poison latch ----------------------------------------------------------------------------------------------

def test_poisoned_guard_refuses_launch_replay_and_reset_naming_the_cause():
    g = HostGuard("push rank 0")
    g.refuse_if_poisoned("launch")                     # healthy: no refusal
    g.poison("drain: stream 0x1 still busy after 4 s")
    for what in ("launch", "graph replay", "reset"):
        with pytest.raises(CollectiveError, match=f"{what} refused: poisoned .drain: stream 0x1 still busy"):
            g.refuse_if_poisoned(what)
    with pytest.raises(CollectiveError, match="poisoned"):
        g.before_replay(1)
    g.poison("a second cause")                          # the first cause is kept
    assert g.reason.startswith("drain")


def test_poison_latch_is_process_wide_and_never_clears():
    a, b = HostGuard("push rank 0"), HostGuard("push rank 1")
    a.poison("cuda error 700")
    assert b.poisoned
    with pytest.raises(CollectiveError, match="this process is poisoned .push rank 0: cuda error 700"):
        b.refuse_if_poisoned("launch")
    c = HostGuard("push rank 0 (new)")
    assert c.poisoned
    a.after_reset()                                     # resetting the book does not clear the latch
    assert a.poisoned and peer_state.process_poison()


# --- epoch book ------------------------------------------------------------------------------------------------

def test_epoch_book_counts_eager_launches_and_replays():
    g = HostGuard("r0")
    for _ in range(3):
        g.count_launch(capturing=False)
    assert g.epoch == 3
    g.begin_capture()
    for _ in range(20):
        g.count_launch(capturing=True)
    assert g.epoch == 3                                 # capture runs nothing
    n = g.end_capture()
    assert n == 20
    g.before_replay(n)
    g.before_replay(n)
    assert g.epoch == 43
    assert g.epochs_left() == EPOCH_LAST - 43


def test_capture_outside_graph_capture_is_refused_before_launching():
    g = HostGuard("r0")
    with pytest.raises(CollectiveError, match="outside graph_capture"):
        g.count_launch(capturing=True)
    g.begin_capture()
    with pytest.raises(CollectiveError, match="not re-entrant"):
        g.begin_capture()


def test_replay_that_would_run_past_the_last_epoch_is_refused_and_reset_starts_a_new_generation():
    g = HostGuard("r0")
    g.epoch = EPOCH_LAST - 19
    g.before_replay(19)
    assert g.epoch == EPOCH_LAST - 0 and g.epochs_left() == 0
    with pytest.raises(CollectiveError, match="past the last epoch .0 left.: drain and reset first"):
        g.before_replay(1)
    g.after_reset()
    assert (g.epoch, g.generation) == (0, 1)
    g.before_replay(20)


def test_eager_launch_count_saturates_one_past_the_last_epoch():
    g = HostGuard("r0")
    g.epoch = EPOCH_LAST
    g.count_launch(False)
    g.count_launch(False)
    assert g.epoch == EPOCH_LAST + 1                    # the device fails closed with ERR_EXHAUSTED there


# --- launch configuration --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 7, 1000, 1024, 1025, 5 * 5120, 20 * 5120, 64 * 5120, (1 << 20) - 1])
def test_launch_config_is_within_the_layout_and_warp_aligned(n):
    nb, thr = ar_launch_config(n)
    assert 1 <= nb <= peer_state.MAXB
    assert thr % 32 == 0 and 32 <= thr <= 1024
    if n <= 1024:
        assert nb == 1                                  # one flag round trip for tiny payloads


def test_exchange_uses_one_block_with_a_thread_per_row():
    assert exchange_threads(1) == 32 and exchange_threads(20) == 32 and exchange_threads(33) == 64
    assert exchange_threads(peer_state.MAXX) <= 128     # push_exchange's __launch_bounds__


# --- handles ---------------------------------------------------------------------------------------------------

def _handle(for_rank, **kw):
    rank = for_rank
    d = dict(version=HANDLE_VERSION, rank=rank, ipc_handle=bytes(64), nbytes=Layout(1024).nbytes,
             layout_digest=Layout(1024).digest(), max_words=1024, nonce=11 + rank, pid=1000 + rank,
             host="h", device="NVIDIA H200 GPU-x")
    d.update(kw)
    return PeerHandle(**d)


def test_peer_handle_round_trips_through_dict_and_pickle():
    h = _handle(0)
    assert PeerHandle.from_dict(h.to_dict()) == h
    assert pickle.loads(pickle.dumps(h)) == h
    check_peer_handle(_handle(0), _handle(1))


@pytest.mark.parametrize("field,value,match", [
    ("rank", 0, "rank: mine 0, peer's 0: a pair is rank 0 and rank 1"),
    ("layout_digest", "beef", "layout_digest: .*same state layout"),
    ("max_words", 2048, "max_words: mine 1024, peer's 2048"),
    ("host", "other", "host: .*one host"),
    ("pid", 1000, "pid: .*connect_local"),
    ("nonce", 11, "nonce"),
    ("ipc_handle", bytes(8), "ipc_handle: mine 64, peer's 8"),
    ("version", 99, "version"),
    ("protocol", "allreduce=lamport", "protocol: .*same collective variants"),
])
def test_peer_handle_refusals_name_the_field_both_values_and_the_rule(field, value, match):
    with pytest.raises(CollectiveError, match=match):
        check_peer_handle(_handle(0), _handle(1, **{field: value}))


# --- capability check ------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_backend_refuses_and_says_why():
    assert "CUDA is not available" in push_unavailable_reason()
    with pytest.raises(CollectiveError, match="push: not usable here: CUDA is not available"):
        PushCollectives(0)


def test_bad_constructor_arguments_are_refused_before_touching_cuda():
    with pytest.raises(CollectiveError, match="rank 2"):
        PushCollectives(2)
    with pytest.raises(CollectiveError, match="allreduce 'ring'"):
        PushCollectives(0, allreduce="ring")
    with pytest.raises(CollectiveError, match="exchange 'x'"):
        PushCollectives(0, exchange="x")


def test_a_poisoned_process_refuses_a_new_backend(monkeypatch):
    import dspark_ray.comm.push as push
    monkeypatch.setattr(push, "push_unavailable_reason", lambda device=None: None)
    peer_state.HostGuard("push rank 0").poison("cuda error 700")
    with pytest.raises(CollectiveError, match="this process is poisoned"):
        PushCollectives(0)


# --- reference oracle ------------------------------------------------------------------------------------------

def _two_rank_refs(parts_by_rank):
    """ReferenceCollectives of rank 0 with a gather that returns the given per-rank tensors in rank order."""
    store = {}

    def gather(t):
        k = store.setdefault("k", 0)
        store["k"] = k + 1
        return [parts_by_rank[0][k], parts_by_rank[1][k]]
    return ReferenceCollectives(0, gather)


def test_reference_sum_is_rank_order_fp32_and_same_bits_sees_nan_payloads_and_signed_zero():
    p0 = torch.tensor([1.0, -0.0, 3.0e38, float("nan")])
    p1 = torch.tensor([2.0, -0.0, 3.0e38, 1.0])
    ref = _two_rank_refs([[p0], [p1]])
    out = ref.all_reduce([p0])
    assert same_bits(out, p0 + p1)
    assert torch.isinf(out[2]) and out[1].item() == 0.0 and torch.signbit(out[1])
    a = torch.tensor([0.0]).view(torch.int32)
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    n1 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    n2 = torch.tensor([0x7FC00002], dtype=torch.int32).view(torch.float32)
    assert not same_bits(n1, n2) and same_bits(n1, n1.clone()) and a.numel() == 1


def test_reference_max_exchange_ties_go_to_rank_0_and_rank_1_wins_only_when_strictly_larger():
    m0, i0 = torch.tensor([1.0, 2.0, float("nan"), 0.5]), torch.tensor([1, 2, 3, 4])
    m1, i1 = torch.tensor([1.0, 3.0, 1.0, float("nan")]), torch.tensor([70001, 70002, 70003, 70004])
    ref = _two_rank_refs([[m0, i0], [m1, i1]])
    v, i = ref.max_exchange([(m0, i0)])
    # tie -> rank 0; larger -> rank 1; a NaN never beats a number (on either rank)
    assert i.tolist() == [1, 70002, 70003, 4]
    assert v.tolist() == [1.0, 3.0, 1.0, 0.5]
    both_nan = torch.tensor([float("nan")])
    ref = _two_rank_refs([[both_nan, torch.tensor([7])], [both_nan, torch.tensor([70007])]])
    assert ref.max_exchange([(both_nan, torch.tensor([7]))])[1].tolist() == [7]


def test_reference_top2_exchange_takes_the_runner_up_from_both_slices():
    t1a, t2a, ia = torch.tensor([5.0, 1.0]), torch.tensor([4.0, 0.5]), torch.tensor([10, 11])
    t1b, t2b, ib = torch.tensor([4.5, 3.0]), torch.tensor([1.0, 2.5]), torch.tensor([70010, 70011])
    ref = _two_rank_refs([[t1a, t2a, ia], [t1b, t2b, ib]])
    t1, t2, i = ref.top2_exchange([(t1a, t2a, ia)])
    assert t1.tolist() == [5.0, 3.0] and t2.tolist() == [4.5, 2.5] and i.tolist() == [10, 70011]


# --- NaN + NaN rule (calibrated against torch's own add) -------------------------------------------------------

def test_nan_rule_decodes_which_nan_torch_returned_per_case():
    from dspark_ray.comm.push import NAN_CALIBRATION_P0 as P0, NAN_CALIBRATION_P1 as P1, nan_rule_from_results
    q = 0x00400000
    assert nan_rule_from_results([P0[t] | q for t in range(4)]) == 0b01010101          # always quiet(P0)
    assert nan_rule_from_results([P1[t] | q for t in range(4)]) == 0b10101010          # always quiet(P1)
    assert nan_rule_from_results([0x7FFFFFFF] * 4) == 0b11111111                       # canonical
    assert nan_rule_from_results([P0[0] | q, P1[1] | q, 0x7FFFFFFF, 0x12345678]) == 0b00111001
    # the calibration pairs keep quiet(P0), quiet(P1) and the canonical NaN apart in every case
    for t in range(4):
        assert len({P0[t] | q, P1[t] | q, 0x7FFFFFFF}) == 3


def test_torch_nan_rule_names_an_input_or_the_canonical_nan_on_cpu():
    from dspark_ray.comm.push import torch_nan_rule
    rule = torch_nan_rule("cpu")
    assert all((rule >> (2 * t)) & 3 in (1, 2, 3) for t in range(4)), hex(rule)
