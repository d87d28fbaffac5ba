"""The analytic NCHW convolution rule (tir_passes/rules/cpu/conv.py): every conv kind of the
zoo (1x1, 3x3, 7x7, stride 2, dilation, groups, depthwise, transposed) with fused epilogues,
weights packed at compile time, against numpy and against stock (unscheduled) TVM."""
import dataclasses
import re

import numpy as np
import pytest
import tvm
import tvm_einweld
from tvm import relax, s_tir, tirx

from conftest import compile_vm, run_vm
from tvm.script import tirx as T
from tvm_einweld.tir_passes.deinterleave import TIR_PIPELINE
from tvm_einweld.tir_passes.device import host_target
from tvm_einweld.tir_passes.rules.cpu import conv, gemm
from tvm_einweld.tir_passes.rules.cpu.apply import cpu_gemm_pipeline, prepack_weights
from tvm_einweld.tir_passes.rules.cpu.isa import VectorISA

TARGET = host_target()
RNG = np.random.default_rng(11)


def conv_module(x_shape, w, bias=None, relu=False, residual=False, transpose=False, **attrs):
    bb = relax.BlockBuilder()
    dtype = str(w.dtype)
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            op = relax.op.nn.conv2d_transpose if transpose else relax.op.nn.conv2d
            y = bb.emit(op(x, relax.const(w, dtype), **attrs))
            if bias is not None:
                y = bb.emit(relax.op.add(y, relax.const(bias.reshape(1, -1, 1, 1), dtype)))
            if relu:
                y = bb.emit(relax.op.nn.relu(y))
            if residual:
                y = bb.emit(relax.op.add(y, y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def run(mod, x, pipeline):
    return run_vm(mod, x, target=TARGET, relax_pipeline=pipeline)


def numpy_conv2d(x, w, stride=1, pad=0, dilation=1, groups=1):
    """NCHW conv2d; stride, pad and dilation an int or (rows, columns)."""
    (sh, sw), (ph, pw), (dh, dw) = (v if isinstance(v, tuple) else (v, v)
                                    for v in (stride, pad, dilation))
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, f, oh, ow), x.dtype)
    fg = f // groups
    for g in range(groups):
        xs = xp[:, g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                win = xs[:, :, i * dh: i * dh + sh * oh: sh, j * dw: j * dw + sw * ow: sw]
                out[:, g * fg:(g + 1) * fg] += np.einsum("nchw,fc->nfhw", win,
                                                         w[g * fg:(g + 1) * fg, :, i, j])
    return out


CASES = {
    "1x1": ((1, 16, 9, 9), (24, 16, 1, 1), dict(padding=0)),         # GEMM rule, A direct
    "1x1_stride2": ((1, 8, 9, 9), (12, 8, 1, 1), dict(strides=2)),    # GEMM rule, A copied
    "3x3": ((2, 8, 11, 13), (12, 8, 3, 3), dict(padding=1)),
    "3x3_stride2": ((1, 8, 15, 15), (16, 8, 3, 3), dict(strides=2, padding=1)),
    "7x7_stride2": ((1, 3, 23, 23), (8, 3, 7, 7), dict(strides=2, padding=3)),
    "3x3_stride2_nopad_oddwidth": ((1, 4, 9, 11), (6, 4, 3, 3), dict(strides=2, padding=0)),
    "stride3_dilated": ((1, 4, 17, 19), (5, 4, 3, 3), dict(strides=3, padding=2, dilation=2)),
    "7x7_map_channels_in_lanes": ((1, 8, 7, 7), (48, 8, 3, 3), dict(padding=1)),
    "dilated": ((1, 4, 12, 12), (6, 4, 3, 3), dict(padding=2, dilation=2)),
    "groups": ((1, 8, 10, 10), (16, 4, 3, 3), dict(padding=1, groups=2)),
    "depthwise": ((1, 8, 10, 10), (8, 1, 3, 3), dict(padding=1, groups=8)),
    # Depthwise with the padded plane made inside each channel's parallel iteration: rows
    # blocked (28 = 4 x 7), a stride-2 odd width (column phases padded), a 5x5 window over a
    # batch, and too few channels for the channel loop (the whole-input copy).
    "depthwise_28": ((1, 16, 28, 28), (16, 1, 3, 3), dict(padding=1, groups=16)),
    "depthwise_stride2_oddwidth": ((1, 6, 13, 11), (6, 1, 3, 3), dict(strides=2, padding=1,
                                                                       groups=6)),
    "depthwise_5x5_batch": ((2, 3, 12, 12), (3, 1, 5, 5), dict(padding=2, groups=3)),
    "depthwise_one_channel_pair": ((1, 2, 9, 9), (2, 1, 3, 3), dict(padding=1, groups=2)),
    "depthwise_multiplier": ((1, 4, 9, 9), (8, 1, 3, 3), dict(padding=1, groups=4)),
    # Output rows of 12 (AVX2: no whole 8-lane vector divides them): 128-bit vectors, after
    # the stride-2 column phases.
    "depthwise_stride2_narrow_rows": ((1, 6, 24, 24), (6, 1, 3, 3), dict(strides=2, padding=1,
                                                                          groups=6)),
    # 88 = 8 x 11 channels on a 28-wide map: no two-vector channel block divides 88 and no
    # whole-vector row block divides 28 (this once left the rule with no block at all).
    "3x3_88_channels": ((1, 8, 28, 28), (88, 8, 3, 3), dict(padding=1)),
    # 128 channels x a 3x3 window: the reduction needs more than L1, so the block is chosen
    # for its L2 traffic (with 32 KiB of L1 and AVX2: one weight vector x 7 positions).
    "dilated_streams_from_l2": ((1, 128, 14, 14), (32, 128, 3, 3), dict(padding=2,
                                                                           dilation=2)),
    # Kernel width 1, stride 1: output rows as one axis of positions (`_flat_positions`),
    # tiles of positions crossing the ends of rows (28 x 28 = 49 x 16; 13 x 11); over a
    # batch, with row dilation, channels in the lanes; a row stride keeps the rows.
    "15x1_flat_positions": ((1, 16, 28, 28), (21, 16, 15, 1), dict(padding=(7, 0))),
    "7x1_flat_odd": ((1, 5, 13, 11), (21, 5, 7, 1), dict(padding=(3, 0))),
    "5x1_flat_batch": ((2, 8, 20, 24), (12, 8, 5, 1), dict(padding=(2, 0))),
    "5x1_flat_dilated": ((2, 8, 20, 24), (12, 8, 5, 1), dict(padding=(4, 0), dilation=(2, 1))),
    "7x1_flat_channels_in_lanes": ((1, 32, 7, 7), (64, 32, 7, 1), dict(padding=(3, 0))),
    # One output channel per group (depthwise-like, copied per channel), positions as above.
    "7x1_flat_one_output_per_group": ((1, 8, 16, 12), (4, 2, 7, 1), dict(padding=(3, 0),
                                                                        groups=4)),
    "3x1_stride2_rows": ((1, 8, 16, 16), (12, 8, 3, 1), dict(padding=(1, 0), strides=(2, 1))),
    # Padded rows longer than `injective.MAX_PIECES` pieces: the copy is cut at whole chunks.
    "depthwise_long_rows": ((1, 4, 3, 901), (4, 1, 3, 3), dict(padding=1, groups=4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_conv2d_against_numpy(name):
    x_shape, w_shape, attrs = CASES[name]
    x, w, b = RNG.standard_normal(x_shape), RNG.standard_normal(w_shape), RNG.standard_normal(
        w_shape[0])
    x, w, b = x.astype("float32"), w.astype("float32"), b.astype("float32")
    mod = conv_module(x_shape, w, bias=b, relu=True, **attrs)
    got = run(mod, x, cpu_gemm_pipeline(TARGET))
    ref = numpy_conv2d(x, w, attrs.get("strides", 1), attrs.get("padding", 0),
                       attrs.get("dilation", 1), attrs.get("groups", 1))
    ref = np.maximum(ref + b.reshape(1, -1, 1, 1), 0)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_all_convs_are_scheduled_and_weights_prepacked():
    for x_shape, w_shape, attrs in CASES.values():
        w = RNG.standard_normal(w_shape).astype("float32")
        with TARGET:
            from tvm.relax.backend.cpu_generic import pipeline as cpu
            low = tvm.transform.Sequential(cpu.legalize_passes(TARGET)
                                           + [prepack_weights(TARGET)])(conv_module(x_shape, w,
                                                                                    **attrs))
        funcs = {g.name_hint: f for g, f in low.functions_items() if isinstance(f, tirx.PrimFunc)}
        assert funcs and all("tirx.is_scheduled" in f.attrs for f in funcs.values()), attrs
        assert "weight_prepack" not in str(low["main"]), attrs  # folded at compile time


@pytest.mark.parametrize("stride,pad,groups", [(2, 1, 1), (1, 0, 1), (2, 1, 2)])
def test_conv2d_transpose_against_stock_tvm(stride, pad, groups):
    x = RNG.standard_normal((1, 8, 6, 6)).astype("float32")
    w = RNG.standard_normal((8, 4, 3, 3)).astype("float32")
    mod = conv_module(x.shape, w, residual=True, transpose=True, strides=stride, padding=pad,
                      groups=groups)
    got = run(mod, x, cpu_gemm_pipeline(TARGET))
    ref = run(mod, x, "default")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_float64_batch():
    x = RNG.standard_normal((3, 5, 7, 9))
    w = RNG.standard_normal((6, 5, 3, 3))
    got = run(conv_module(x.shape, w, padding=1), x, cpu_gemm_pipeline(TARGET))
    np.testing.assert_allclose(got, numpy_conv2d(x, w, pad=1), rtol=1e-10, atol=1e-10)


def test_register_block_is_exact_and_fits():
    isa = VectorISA(512, 32, True, masked=True)
    shape = conv.ConvShape(1, 64, 56, 56, "float32", rows_share_data=(1, 2, 4, 8, 16, 32, 64))
    blk = conv.choose_conv_block(isa, shape)
    assert 64 % blk.mr == 0 and 56 % blk.yb == 0 and 56 % blk.xb == 0
    assert blk.broadcasts * blk.vectors + blk.vectors + 1 <= isa.registers
    # Rows of 14 fill 14 of 16 lanes; the model ranks 32 channels x positions ahead (measured
    # 457 vs 415 GFLOP/s), with at most half the registers in accumulators.
    assert blk.channels_in_lanes and blk.broadcasts * blk.vectors <= isa.registers // 2
    assert blk.vectors >= 2  # one weight vector per step: each FMA waits on its broadcast
    # Without masked vectors a 14-column row would be assembled lane by lane: channels go
    # in the lanes instead, and 8-column rows (56 = 7 x 8) stay rows of whole vectors.
    avx2 = VectorISA(256, 16, True)
    narrow = conv.choose_conv_block(avx2, conv.ConvShape(1, 256, 14, 14, "float32",
                                                          (1, 2, 4, 8, 16, 32, 64, 128, 256)))
    assert narrow.channels_in_lanes
    wide = conv.choose_conv_block(avx2, shape)
    assert not wide.channels_in_lanes and wide.xb % 8 == 0
    depthwise = conv.choose_conv_block(isa, conv.ConvShape(1, 32, 7, 7, "float32", (1,)))
    assert depthwise.mr == 1 and not depthwise.channels_in_lanes
    rows = conv.choose_conv_block(isa, conv.ConvShape(1, 192, 28, 28, "float32", (1,)))
    # Rows blocked for independent accumulators, but no more than hide the FMA latency.
    assert rows.yb > 1 and rows.vectors <= isa.fma_units * isa.fma_latency
    # Depthwise rows of 28 on AVX2 (3.5 vectors of 8): whole 4-lane (128-bit) vectors, not
    # 7-lane ones assembled lane by lane; rows of 56 keep full vectors.
    narrow_rows = conv.choose_conv_block(avx2, conv.ConvShape(1, 192, 28, 28, "float32", (1,)))
    assert narrow_rows.lanes == 4 and narrow_rows.xb == 4
    assert conv.choose_conv_block(avx2, conv.ConvShape(1, 144, 56, 56, "float32",
                                                       (1,))).lanes == 8
    small_map = conv.choose_conv_block(isa, conv.ConvShape(1, 512, 7, 7, "float32", (16, 32)))
    assert small_map.channels_in_lanes and small_map.mr % 16 == 0
    # With 16 registers two weight vectors leave room for one position of a 7x7 map (4
    # accumulators, FMA-latency bound): one weight vector and a row of 7 positions instead.
    zen1 = VectorISA(256, 16, True, fma_units=1, fma_latency=5, fma_pipe_bits=128)
    shared = tuple(conv._divisors(512))
    seven = conv.choose_conv_block(zen1, conv.ConvShape(1, 512, 7, 7, "float32", shared))
    assert seven.channels_in_lanes and seven.vectors == 1 and seven.broadcasts == 7
    wide = conv.choose_conv_block(zen1, conv.ConvShape(1, 256, 14, 14, "float32", shared[:9]))
    assert wide.vectors >= 2  # enough accumulators with two weight vectors: kept


def _window_of(x_shape, w_shape, **attrs):
    mod = conv_module(x_shape, np.zeros(w_shape, "float32"), **attrs)
    (func,) = [f for _, f in relax.transform.LegalizeOps()(mod).functions_items()
               if isinstance(f, tirx.PrimFunc)]
    sch = tvm.s_tir.Schedule(func)
    return conv._match(sch, conv.gemm.find_gemm_block(sch))[2].window


def test_the_window_is_read_off_the_data_index():
    """Kernel extents, strides and dilations per axis (rows, columns) and the input channels
    per group, from the legalised function itself."""
    window = _window_of((1, 12, 20, 30), (8, 6, 3, 5), strides=(1, 2), dilation=(3, 1),
                        padding=2, groups=2)
    assert window == conv.ConvWindow(channels=6, kernel=(3, 5), stride=(1, 2), dilation=(3, 1))


def test_blocks_that_stream_from_l2_are_costed_by_their_lines():
    """Where the reduction of a block needs more than L1 its lines come from L2: a dilated 3x3
    window read by 2 x 2 positions spans 6 input rows, by a row of 7 positions only 3, and per
    FMA the row block streams fewer bytes. Within L1 nothing is charged."""
    caches = conv.gemm.CacheSizes(l1=32 * 1024, l2=512 * 1024)
    window = conv.ConvWindow(512, (3, 3), (1, 1), (2, 2))
    shape = conv.ConvShape(1, 512, 14, 14, "float32", tuple(conv._divisors(512)), window)
    square, row = conv.ConvBlock(16, 2, 2, 8, True), conv.ConvBlock(8, 1, 7, 8, True)
    per_fma = lambda blk: conv.streamed_cycles(blk, shape, caches) / (
        blk.broadcasts * blk.vectors)
    assert per_fma(square) > per_fma(row) > 0
    small = conv.ConvShape(1, 512, 14, 14, "float32", shape.rows_share_data,
                           conv.ConvWindow(8, (3, 3), (1, 1), (2, 2)))
    assert conv.streamed_cycles(square, small, caches) == 0
    assert conv.streamed_cycles(square, shape, None) == 0  # no cache sizes: no term
    # The choice on a Zen 3 core (two 256-bit FMA pipes, 16 registers): one weight vector and
    # a row of positions, as measured (8 x 1 x 7: 132 GFLOP/s, 16 x 2 x 2: 113).
    zen3 = VectorISA(256, 16, True, fma_units=2, fma_latency=4)
    chosen = conv.choose_conv_block(zen3, shape, caches)
    assert chosen.channels_in_lanes and chosen.vectors == 1 and chosen.yb == 1
    assert conv.choose_conv_block(zen3, shape).vectors == 2  # the register model alone


ZEN3_CACHES = conv.gemm.CacheSizes(l1=32 * 1024, l2=512 * 1024)


def _order_case(channels, size, out, kernel, rows_block):
    """(block, shape, data bytes, weight bytes) of a stride-1 conv padded to keep its size."""
    kh, kw = kernel
    window = conv.ConvWindow(channels, kernel, (1, 1), (1, 1))
    shape = conv.ConvShape(1, out, size, size, "float32", tuple(conv._divisors(out)), window)
    data = 4 * channels * (size + kh - 1) * (size + kw - 1)
    return rows_block, shape, data, 4 * out * channels * kh * kw


def test_position_tiles_go_outer_where_that_spares_l3_traffic():
    """ResNet-18's 64 -> 64 channels at 56x56 (input 841 KiB, beyond L2; 16 channel tiles of
    4): positions outer read the input once instead of 16 times, and one tile's window (64
    channels x 4 rows) fits L1. GCN's 15x1 128 -> 21 at 28x28: fewer bytes beyond L2 too, but
    its tall window (16 rows x 128 channels) does not fit L1: channel tiles stay outer. An input
    within half of L2 is read once either way, and without cache sizes nothing changes."""
    resnet = _order_case(64, 56, 64, (3, 3), conv.ConvBlock(4, 2, 8, 8))
    assert conv.positions_outer(resnet[0], resnet[1], ZEN3_CACHES, *resnet[2:])
    assert not conv.positions_outer(resnet[0], resnet[1], None, *resnet[2:])
    tall = _order_case(128, 28, 21, (15, 1), conv.ConvBlock(3, 2, 7, 8))
    assert not conv.positions_outer(tall[0], tall[1], ZEN3_CACHES, *tall[2:])
    small = _order_case(64, 14, 64, (3, 3), conv.ConvBlock(4, 2, 7, 8))
    assert not conv.positions_outer(small[0], small[1], ZEN3_CACHES, *small[2:])


def test_positions_outer_schedule_against_numpy(monkeypatch):
    """The tile order with positions outer, with bias and ReLU in the write-back, against
    numpy. The order is forced: whether the rule picks it depends on the host's register
    block and caches (the decision is tested above on fixed shapes and caches)."""
    monkeypatch.setattr(conv, "positions_outer", lambda *args: True)
    monkeypatch.setattr(conv, "copy_band", lambda *args: None)  # the order without bands
    x_shape, w_shape = (1, 64, 32, 32), (64, 64, 3, 3)
    x = RNG.standard_normal(x_shape).astype("float32")
    w = RNG.standard_normal(w_shape).astype("float32")
    b = RNG.standard_normal(64).astype("float32")
    with TARGET:
        from tvm.relax.backend.cpu_generic import pipeline as cpu
        low = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(
            conv_module(x_shape, w, bias=b, relu=True, padding=1))
    (func,) = [f for f in low.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = conv.schedule_conv(func, TARGET)
    # The fused parallel loop runs the channel tiles innermost: its name ends with theirs.
    (tile,) = [sch.get(lp) for lp in sch.get_loops(sch.get_sblock("conv2d_nchw_update"))
               if sch.get(lp).kind == tirx.ForKind.PARALLEL]
    assert str(tile.loop_var).endswith("ff_0_fused"), tile.loop_var
    # The direct convolution: its Winograd form (a derivation candidate) is tested apart.
    direct = tvm_einweld.pipeline(TARGET, derive_options={"winograd": False})
    out = run(conv_module(x_shape, w, bias=b, relu=True, padding=1), x, direct)
    np.testing.assert_allclose(out, np.maximum(numpy_conv2d(x, w, pad=1)
                                               + b.reshape(1, -1, 1, 1), 0), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("isa", [VectorISA(128, 16, False), VectorISA(256, 16, True),
                                 VectorISA(512, 32, True, masked=True)], ids=str)
def test_every_shape_gets_an_exact_block_that_fits(isa):
    for channels in range(1, 140):
        for size in (1, 3, 7, 13, 14, 28, 56):
            for share in (tuple(conv._divisors(channels)), (1,)):
                blk = conv.choose_conv_block(isa, conv.ConvShape(1, channels, size, size,
                                                                 "float32", share))
                assert channels % blk.mr == 0 and size % blk.yb == 0 and size % blk.xb == 0
                assert conv.gemm.fits_registers(isa, blk.broadcasts, blk.vectors)


def test_planted_fault_wrong_weights_layout_is_caught():
    """Compile the scheduled kernel alone and feed it weights packed for a different block:
    the numeric check rejects it."""
    x_shape, w_shape, attrs = CASES["3x3"]
    x = RNG.standard_normal(x_shape).astype("float32")
    w = RNG.standard_normal(w_shape).astype("float32")
    with TARGET:
        from tvm.relax.backend.cpu_generic import pipeline as cpu
        low = tvm.transform.Sequential(cpu.legalize_passes(TARGET) + [prepack_weights(TARGET)])(
            conv_module(x_shape, w, **attrs))
    (func,) = [f for g, f in low.functions_items() if g.name_hint.endswith("prepacked")]
    assert len(func.params[1].shape) == 5  # [F/mr, C, KH, KW, mr]: the Conv2D rule's pack
    mr = int(func.params[1].shape[-1])
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), TARGET)
    ref = numpy_conv2d(x, w, pad=1)

    def matches(packed):
        out = tvm.runtime.tensor(np.zeros(ref.shape, "float32"))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(packed), out)
        return np.allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)

    f = w.shape[0]
    good = w.reshape(f // mr, mr, *w.shape[1:]).transpose(0, 2, 3, 4, 1).copy()
    assert matches(good)
    assert not matches(good[..., ::-1].copy())           # channels reversed within a block
    assert not matches(np.roll(good, 1, axis=2).copy())  # kernel rows shifted


def _legalized_conv(name):
    x_shape, w_shape, attrs = CASES[name]
    w = RNG.standard_normal(w_shape).astype("float32")
    with TARGET:
        from tvm.relax.backend.cpu_generic import pipeline as cpu
        low = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(conv_module(x_shape, w,
                                                                                 **attrs))
    (func,) = [f for f in low.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


@pytest.mark.parametrize("name,in_channel_loop", [("depthwise_28", True),
                                                   ("depthwise_one_channel_pair", False),
                                                   ("3x3", False)])
def test_depthwise_pads_each_plane_inside_its_parallel_channel_loop(name, in_channel_loop,
                                                                  monkeypatch):
    """Depthwise: the padding copy shares the kernel's parallel loop (one plane per channel,
    kept in L1); too few channels to feed every core, or a dense conv without row bands
    (`copy_band`, tested below): one whole copy."""
    monkeypatch.setattr(conv, "copy_band", lambda *args: None)
    sch = conv.schedule_conv(_legalized_conv(name), TARGET)
    (pad,) = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
              if sch.get(b).name_hint.startswith("pad_temp")]  # (its row loop's pieces inside)
    outer = sch.get(sch.get_loops(pad)[0])
    assert outer.kind == tirx.ForKind.PARALLEL
    shared = any(sch.get(sch.get_loops(b)[0]).same_as(outer)
                 for b in sch.get_child_blocks(sch.get_sblock("root"))
                 if "conv" in sch.get(b).name_hint)
    assert shared == in_channel_loop


def test_copy_band_sizes():
    """Row tiles per band of the padded copy: the largest band whose copy fits half of L2,
    with the bands spread evenly over the cores, TILES_PER_CORE or more each; none where the
    weights do not fit in L2 or the map is too short for enough bands."""
    caches = gemm.CacheSizes(l1=48 * 1024, l2=2 * 1024 * 1024)
    block = conv.ConvBlock(7, 2, 16, 16)

    def shape(channels, size, kernel=(3, 3), dilation=(1, 1)):
        return conv.ConvShape(1, 21, size, size, "float32", (1, 3, 7, 21),
                              conv.ConvWindow(channels, kernel, (1, 1), dilation))

    row = 21 * 226 * 4  # one padded input row, every channel
    # GCN's 3x3 at 224x224: 112 row tiles; 14 per band (8 bands, 30 rows = 570 KiB).
    assert conv.copy_band(shape(21, 224), block, caches, 2, 4 * 21 * 21 * 9, row) == 14
    # A fatter input row: the copy limit binds first.
    assert conv.copy_band(shape(21, 224), block, caches, 2, 4 * 21 * 21 * 9, 8 * row) == 2
    # Three cores: the band count must divide among them (112 / 3 does not, 56 / ... either).
    assert conv.copy_band(shape(21, 224), block, caches, 3, 4 * 21 * 21 * 9, row) is None
    # Weights beyond L2 would come from memory again for every band; within it, banded.
    assert conv.copy_band(shape(21, 224), block, caches, 2, caches.l2 + 4, row) is None
    assert conv.copy_band(shape(21, 224), block, caches, 2, caches.l2, row) == 14
    # A 14x14 map has 7 row tiles: too few bands.
    assert conv.copy_band(shape(21, 14), block, caches, 2, 4 * 21 * 21 * 9, row) is None
    # A dilated window's halo counts: 2t + 4 rows of a fat row, against 2t + 2 above.
    assert conv.copy_band(shape(21, 224, dilation=(2, 2)), block, caches, 2, 4 * 21 * 21 * 9,
                          8 * row) == 1
    # A row stride of 2: a band of t row tiles (2t output rows) reads 4t + 1 input rows.
    strided = conv.ConvShape(1, 21, 112, 112, "float32", (1, 3, 7, 21),
                             conv.ConvWindow(21, (3, 3), (2, 2), (1, 1)))
    assert conv.copy_band(strided, block, caches, 2, 4 * 21 * 21 * 9, 8 * row) == 1
    assert conv.copy_band(strided, block, caches, 2, 4 * 21 * 21 * 9, row) == 7


def _copy_and_kernel_loops(x_shape, w_shape, attrs):
    """A random conv + bias + ReLU module, its inputs, and the outermost loops of the padded
    input copy (its row pieces inside) and of the kernel in the rule's schedule."""
    x = RNG.standard_normal(x_shape).astype("float32")
    w = RNG.standard_normal(w_shape).astype("float32")
    b = RNG.standard_normal(w_shape[0]).astype("float32")
    mod = conv_module(x_shape, w, bias=b, relu=True, **attrs)
    with TARGET:
        from tvm.relax.backend.cpu_generic import pipeline as cpu
        low = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(mod)
    (func,) = [f for f in low.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = conv.schedule_conv(func, TARGET)
    (pad,) = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
              if sch.get(b).name_hint.startswith("pad_temp")]
    (update,) = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
                 if sch.get(b).name_hint.endswith("conv2d_nchw_update")]
    copy_outer, conv_outer = (sch.get(sch.get_loops(b)[0]) for b in (pad, update))
    return x, w, b, mod, copy_outer, conv_outer


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((2, 8, 11, 13), (12, 8, 3, 3), dict(padding=1)),
    ((1, 4, 12, 17), (6, 4, 3, 3), dict(padding=2, dilation=2)),
    ((1, 8, 10, 10), (16, 4, 3, 3), dict(padding=1, groups=2)),
    ((1, 6, 9, 20), (7, 6, 1, 15), dict(padding=(0, 7))),
    ((1, 8, 7, 7), (48, 8, 3, 3), dict(padding=1)),
    ((2, 8, 13, 15), (12, 8, 3, 3), dict(padding=1, strides=2)),
    ((1, 3, 17, 19), (8, 3, 7, 7), dict(padding=3, strides=2)),
    ((1, 8, 11, 9), (32, 8, 3, 3), dict(padding=1, strides=(2, 1))),
], ids=["3x3_batch2_odd", "dilated", "groups", "1x15", "channels_in_lanes", "stride2_odd",
        "7x7_stride2", "row_stride_only"])
def test_banded_padded_copy_against_numpy(monkeypatch, x_shape, w_shape, attrs):
    """The padded copy made band by band inside the parallel loop (every row tile a band,
    forced: which shapes get bands depends on the host's caches and cores), against numpy:
    each band's copy covers its halo rows, in odd sizes, dilated, grouped, with a 1x15
    window, with channels in the lanes, and strided (a band of output rows reads twice as
    many input rows; with a column stride the copy is in column phases, padded where the
    width is odd)."""
    monkeypatch.setattr(conv, "copy_band", lambda *args: 1)
    x, w, b, mod, outer, conv_outer = _copy_and_kernel_loops(x_shape, w_shape, attrs)
    assert outer.kind == tirx.ForKind.PARALLEL and outer.same_as(conv_outer)
    direct = tvm_einweld.pipeline(TARGET, derive_options={"winograd": False})
    pad = attrs["padding"]
    ref = numpy_conv2d(x, w, stride=attrs.get("strides", 1), pad=pad,
                       dilation=attrs.get("dilation", 1), groups=attrs.get("groups", 1))
    np.testing.assert_allclose(run(mod, x, direct),
                               np.maximum(ref + b.reshape(1, -1, 1, 1), 0), rtol=1e-4,
                               atol=1e-4)


def _pad_blocks(sch):
    """The leaf blocks of the padded input copy (one per piece of its cut row loop)."""
    out, todo = [], list(sch.get_child_blocks(sch.get_sblock("root")))
    while todo:
        block = todo.pop()
        children = sch.get_child_blocks(block)
        if children:
            todo += children
        elif sch.get(block).name_hint.startswith("pad_temp"):
            out.append(block)
    return out


@pytest.mark.parametrize("name", ["depthwise_28", "depthwise_stride2_oddwidth", "3x3",
                                  "7x7_stride2", "depthwise_one_channel_pair",
                                  "3x3_stride2_nopad_oddwidth", "stride3_dilated"])
def test_the_padded_copy_is_vectorised_along_its_rows(name):
    """The padded input copy runs in vectors along its rows; only the positions where the
    padding condition changes run scalar, no more of them than a row's padded columns (plus
    one for an odd width's column-phase padding), and no vector is turned back into scalar
    code by TVM's vectoriser (which it does where a condition differs between lanes):
    `injective.vectorize_segments` (numerics: `test_conv2d_against_numpy`)."""
    sch = conv.schedule_conv(_legalized_conv(name), TARGET)
    pieces = [sch.get(sch.get_loops(b)[-1]) for b in _pad_blocks(sch)]
    assert pieces
    scalar = sum(int(p.extent) for p in pieces if p.kind != tirx.ForKind.VECTORIZED)
    vector = sum(int(p.extent) for p in pieces if p.kind == tirx.ForKind.VECTORIZED)
    assert scalar <= 2 * CASES[name][2].get("padding", 0) + 1, scalar
    assert vector >= scalar, (vector, scalar)
    mod = tvm.tirx.transform.BindTarget(TARGET.with_host(TARGET))(
        tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}))
    lowered = tvm.tirx.get_tir_pipeline("default")[0](mod).script()
    # VectorizeLoop names a loop it turned back into scalar code `<lane>_s`.
    assert not re.search(r"for [\w, ]*\w_s\b", lowered), lowered


@pytest.mark.parametrize("name,flat", [("15x1_flat_positions", True), ("7x1_flat_odd", False),
                                       ("3x1_stride2_rows", False), ("3x3", False)])
def test_positions_replace_rows_only_where_they_fill_lanes(name, flat):
    """Kernel width 1 and stride 1, rows of 28 (blocks of 14 fill 14 of 16 lanes),
    28 x 28 positions whole vectors: positions. 13 x 11 positions fill no whole vector, a row
    stride breaks contiguity, a 3-wide kernel reads columns: rows (numerics for all:
    `test_conv2d_against_numpy`)."""
    func = _legalized_conv(name)
    sch = tvm.s_tir.Schedule(func)
    block = conv.gemm.find_gemm_block(sch)
    data_index, _, shape = conv._match(sch, block)
    isa = conv.vector_isa(TARGET)
    assert conv._flat_positions(sch, block, data_index, shape, isa.lanes(shape.dtype)) == flat


def _vector_widths(stmt, names: tuple, inside: int | None = None) -> list[int]:
    """The extents of the vectorised loops around the blocks called `names` in a TIR tree."""
    if isinstance(stmt, tirx.SeqStmt):
        return [w for child in stmt.seq for w in _vector_widths(child, names, inside)]
    if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.VECTORIZED:
        inside = int(stmt.extent)
    widths = []
    if isinstance(stmt, s_tir.SBlock) and stmt.name_hint in names and inside:
        widths.append(inside)
    for attr in ("block", "body", "init", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if isinstance(child, tirx.Stmt):
            widths += _vector_widths(child, names, inside)
    return widths


@pytest.mark.parametrize("case,vectors", [("15x1_flat_positions", 7), ("3x3_row_of_3", 3)])
def test_rows_of_several_vectors_are_unrolled_vector_by_vector(monkeypatch, case, vectors):
    """A block of several vectors of positions (7 x 16 of GCN's 784 positions, 3 vectors of
    a 48-wide row) runs as that many unrolled vectors of the ISA's width, in the k loop and
    in the write-back: a 112-lane vector left to LLVM had been 30x slower. Against numpy,
    with the block forced (the model's pick depends on the host)."""
    lanes = conv.vector_isa(TARGET).lanes("float32")
    x_shape, w_shape, attrs = {
        "15x1_flat_positions": CASES["15x1_flat_positions"],
        "3x3_row_of_3": ((1, 4, 6, 3 * lanes), (6, 4, 3, 3), dict(padding=1)),
    }[case]
    block = conv.ConvBlock(3, 1, vectors * lanes, lanes)
    monkeypatch.setattr(conv, "choose_conv_block", lambda *args, **kwargs: block)
    x, w, b = (RNG.standard_normal(s).astype("float32") for s in (x_shape, w_shape,
                                                                  w_shape[:1]))
    with TARGET:
        from tvm.relax.backend.cpu_generic import pipeline as cpu
        low = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(
            conv_module(x_shape, w, bias=b, **attrs))
    (func,) = [f for f in low.functions.values() if isinstance(f, tirx.PrimFunc)]
    sch = conv.schedule_conv(func, TARGET)
    # The k loop and its initialisation: vectors of the ISA's width.
    widths = _vector_widths(sch.mod["main"].body, ("conv2d_nchw_init", "conv2d_nchw_update"))
    assert widths == [lanes, lanes], widths
    direct = tvm_einweld.pipeline(TARGET, derive_options={"winograd": False})
    out = run(conv_module(x_shape, w, bias=b, **attrs), x, direct)
    ref = numpy_conv2d(x, w, 1, attrs["padding"]) + b.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_a_block_of_positions_may_end_past_the_last_position(monkeypatch):
    """Rows as one axis of positions (28 x 28 = 784, over a batch of 2): a block of 3 vectors
    (7 channels x 48 positions on AVX-512) does not divide them; the last tile of each image
    ends past position 784, its tail kept from computing, reading and writing by split's
    predicate. Against numpy, with bias, the block forced (the model's pick depends on the
    host)."""
    lanes = conv.vector_isa(TARGET).lanes("float32")
    x_shape, w_shape, attrs = (2, 16, 28, 28), (21, 16, 15, 1), dict(padding=(7, 0))
    block = conv.ConvBlock(7, 1, 3 * lanes, lanes)
    assert (28 * 28) % block.xb  # the case: a ragged last tile
    monkeypatch.setattr(conv, "choose_conv_block", lambda *args, **kwargs: block)
    x, w, b = (RNG.standard_normal(s).astype("float32") for s in (x_shape, w_shape,
                                                                  w_shape[:1]))
    direct = tvm_einweld.pipeline(TARGET, derive_options={"winograd": False})
    out = run(conv_module(x_shape, w, bias=b, **attrs), x, direct)
    ref = numpy_conv2d(x, w, 1, attrs["padding"]) + b.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


LANES = conv.vector_isa(TARGET).lanes("float32")
CORES = conv.gemm.target_cores(TARGET)


@pytest.mark.parametrize("x_shape,w_shape,attrs,mode,vectors", [
    ((2, 16, 28, 28), (21, 16, 15, 1), dict(padding=(7, 0)), conv.WHOLE, None),
    ((1, 5, 16, 12), (7, 5, 7, 1), dict(padding=(3, 0)), conv.PART, None),
    ((2, 8, 20, 24), (12, 8, 5, 1), dict(padding=(4, 0), dilation=(2, 1)), conv.PART, None),
    # 8 vectors of positions per core in blocks of 3: each core's last tile ragged.
    ((1, 6, 16 * CORES, LANES // 2), (9, 6, 7, 1), dict(padding=(3, 0)), conv.PART, 3),
    ((1, 16, 28, 28), (21, 16, 15, 1), dict(padding=(7, 0)), None, None),
], ids=["whole_batch2_ragged_tiles", "part_odd_channels", "part_dilated_batch2",
        "part_ragged_per_core", "shared"])
def test_a_copy_of_the_padded_input_per_core(monkeypatch, x_shape, w_shape, attrs, mode,
                                             vectors):
    """Rows as one axis of positions, each core copying the rows its share of the positions
    reads (PART: whole vectors per core) or the whole padded input (WHOLE: 784 positions, 49
    vectors) before its share of the tiles (`core_copy`, forced: which one depends on the
    host's L2): the copy sits inside the parallel loop of the tiles (shared: in a parallel
    loop of its own), and the result matches numpy with bias and ReLU, where the tiles do
    not divide among the cores, over a batch, dilated, and where each core's last tile is
    ragged (its tail must not write over the next core's first positions: a race, so the
    module is called a hundred times)."""
    def forced(caches, whole, part, weight_bytes):
        assert (part is not None) == (mode == conv.PART) or mode is None
        return mode

    monkeypatch.setattr(conv, "core_copy", forced)
    if vectors:
        block = conv.ConvBlock(3, 1, vectors * LANES, LANES)
        monkeypatch.setattr(conv, "choose_conv_block", lambda *args, **kwargs: block)
    x, w, b, mod, copy_outer, conv_outer = _copy_and_kernel_loops(x_shape, w_shape, attrs)
    assert copy_outer.kind == conv_outer.kind == tirx.ForKind.PARALLEL
    assert copy_outer.same_as(conv_outer) == (mode is not None)
    call = compile_vm(mod, TARGET, cpu_gemm_pipeline(TARGET))  # unchecked: the rule's kernel
    ref = np.maximum(numpy_conv2d(x, w, pad=attrs["padding"],
                                  dilation=attrs.get("dilation", 1)) + b.reshape(1, -1, 1, 1), 0)
    for _ in range(100):
        np.testing.assert_allclose(call(x), ref, rtol=1e-4, atol=1e-4)


def test_a_flat_conv_with_one_output_per_group_is_copied_per_channel(monkeypatch):
    """Positions as one axis, one output channel per group: the copy is made per channel
    (the depthwise path), never per core, whatever `core_copy` would say (its core split had
    broken the depthwise path's loop fusion: the rule failed). Numerics:
    `test_conv2d_against_numpy`."""
    monkeypatch.setattr(conv, "core_copy", lambda *args: conv.PART)
    assert conv.schedule_conv(_legalized_conv("7x1_flat_one_output_per_group"), TARGET)


def test_a_copy_per_core_only_where_it_and_the_weights_fit_half_of_l2():
    """GCN's 15x1 convolutions on 2 MiB of L2: 128 -> 21 at 28x28 (49 vectors of positions:
    no part per core; the whole 602 KiB copy and 161 KiB of weights fit) copies the whole
    input per core; 64 -> 21 at 56x56 copies the 43 rows one core's half reads (the whole
    0.96 MiB copy would not fit), or shares one copy where its positions do not split; no
    cache model, one shared copy."""
    caches = conv.gemm.CacheSizes(l1=48 * 1024, l2=2 * 1024 * 1024)
    assert conv.core_copy(caches, 4 * 128 * 42 * 28, None, 4 * 21 * 128 * 15) == conv.WHOLE
    row = 4 * 64 * 56
    assert conv.core_copy(caches, 70 * row, 43 * row, 4 * 21 * 64 * 15) == conv.PART
    assert conv.core_copy(caches, 70 * row, None, 4 * 21 * 64 * 15) is None
    assert conv.core_copy(None, 4, 4, 4) is None


def test_position_blocks_need_not_divide_the_positions():
    """GCN's 15x1 convolutions to 21 channels at 28x28 on an AVX-512 core (48 KiB L1, 2 MiB
    L2): the exact blocks of 784 = 49 x 16 positions are 1 or 7 vectors; over 128 input
    channels, whose window streams from L2, the model takes 7 channels x 3 vectors (17 tiles,
    measured 283 -> 258 us); over 21 channels it ties 7 x 3 with 7 x 2 and takes the one with
    fewer positions past the end (7 x 2: 16 of 800; measured 64 -> 61 us). Rows that are not
    positions keep exact blocks (`test_every_shape_gets_an_exact_block_that_fits`)."""
    isa = VectorISA(512, 32, True, masked=True)
    caches = conv.gemm.CacheSizes(l1=48 * 1024, l2=2 * 1024 * 1024)

    def shape(channels):
        return conv.ConvShape(1, 21, 1, 784, "float32", (1, 3, 7, 21),
                              conv.ConvWindow(channels, (15, 1), (1, 1), (1, 1)), positions=True)

    assert conv.position_blocks(shape(128), 16, 32)[:6] == [1, 2, 4, 7, 8, 14]
    assert 48 in conv.position_blocks(shape(128), 16, 32)
    assert 48 not in conv.position_blocks(dataclasses.replace(shape(128), positions=False), 16, 32)
    assert conv.choose_conv_block(isa, shape(128), caches) == conv.ConvBlock(7, 1, 48, 16)
    assert conv.choose_conv_block(isa, shape(21), caches) == conv.ConvBlock(7, 1, 32, 16)


# The last phase of a 4x4/s2 transposed convolution as a tile kernel ends it (TileGraphFusion):
# the phase's 2x2 convolution, then the other three phases (parameters) stacked, reshaped and
# interleaved with it into the output, every other row and column.
@T.prim_func(s_tir=True)
def _phase_and_interleave(
        x: T.Buffer((T.int64(1), T.int64(4), T.int64(7), T.int64(9)), "float32"),
        w: T.Buffer((T.int64(5), T.int64(4), T.int64(2), T.int64(2)), "float32"),
        p0: T.Buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(8)), "float32"),
        p1: T.Buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(8)), "float32"),
        p2: T.Buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(8)), "float32"),
        out: T.Buffer((T.int64(1), T.int64(5), T.int64(12), T.int64(16)), "float32"),
):
    T.func_attr({"tirx.noalias": True})
    conv_out = T.sblock_alloc_buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(8)))
    stack = T.sblock_alloc_buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(8), T.int64(2)))
    rows = T.sblock_alloc_buffer((T.int64(1), T.int64(5), T.int64(6), T.int64(16)))
    for n, f, y, xx, c, ky, kx in T.grid(T.int64(1), T.int64(5), T.int64(6), T.int64(8),
                                         T.int64(4), T.int64(2), T.int64(2)):
        with T.sblock("conv2d_nchw"):
            vn, vf, vy, vx, vc, vky, vkx = T.axis.remap("SSSSRRR", [n, f, y, xx, c, ky, kx])
            with T.init():
                conv_out[vn, vf, vy, vx] = T.float32(0)
            conv_out[vn, vf, vy, vx] = conv_out[vn, vf, vy, vx] + \
                x[vn, vc, vy + vky, vx + vkx] * w[vf, vc, vky, vkx]
    for n, f, y, xx, p in T.grid(T.int64(1), T.int64(5), T.int64(6), T.int64(8), T.int64(2)):
        with T.sblock("T_stack"):
            vn, vf, vy, vx, vp = T.axis.remap("SSSSS", [n, f, y, xx, p])
            stack[vn, vf, vy, vx, vp] = T.if_then_else(vp == T.int64(1), p1[vn, vf, vy, vx],
                                                       p0[vn, vf, vy, vx])
    for n, f, y, xx in T.grid(T.int64(1), T.int64(5), T.int64(6), T.int64(16)):
        with T.sblock("T_reshape"):
            vn, vf, vy, vx = T.axis.remap("SSSS", [n, f, y, xx])
            rows[vn, vf, vy, vx] = stack[vn, vf, vy, vx // T.int64(2), vx % T.int64(2)]
    for n, f, y, xx in T.grid(T.int64(1), T.int64(5), T.int64(12), T.int64(16)):
        with T.sblock("T_reshape2"):
            vn, vf, vy, vx = T.axis.remap("SSSS", [n, f, y, xx])
            out[vn, vf, vy, vx] = T.if_then_else(
                vy % T.int64(2) == T.int64(1),
                T.if_then_else(vx % T.int64(2) == T.int64(1),
                               conv_out[vn, vf, vy // T.int64(2), vx // T.int64(2)],
                               p2[vn, vf, vy // T.int64(2), vx // T.int64(2)]),
                rows[vn, vf, vy // T.int64(2), vx])


def test_a_tile_kernel_puts_the_phases_together_in_one_vectorised_pass():
    """The blocks after the convolution that read other inputs (stack, reshape) are inlined
    into the interleave, which runs as vectors of each phase (they had stayed three serial
    scalar passes at the root: 60 of the 95 us of GCN's 21-channel kernel at 56x56).
    Against numpy."""
    sch = conv.schedule_conv(_phase_and_interleave, TARGET)
    names = _block_names(sch.mod["main"].body)
    assert "T_stack" not in names and "T_reshape" not in names, names
    interleave = sch.get_sblock("T_reshape2")
    kinds = [sch.get(lp).kind for lp in sch.get_loops(interleave)]
    assert kinds[-1] == tirx.ForKind.VECTORIZED and tirx.ForKind.UNROLLED in kinds, kinds
    lib = tvm.tirx.build(tvm.IRModule({"main": sch.mod["main"].with_attr(
        "global_symbol", "main")}), target=TARGET, pipeline=TIR_PIPELINE)
    x, w, p0, p1, p2 = (RNG.standard_normal(s).astype("float32") for s in (
        (1, 4, 7, 9), (5, 4, 2, 2), (1, 5, 6, 8), (1, 5, 6, 8), (1, 5, 6, 8)))
    args = [tvm.runtime.tensor(a) for a in (x, w, p0, p1, p2)] + [
        tvm.runtime.tensor(np.zeros((1, 5, 12, 16), "float32"))]
    lib["main"](*args)
    ref = np.empty((1, 5, 12, 16), "float32")
    ref[:, :, 0::2, 0::2], ref[:, :, 0::2, 1::2], ref[:, :, 1::2, 0::2] = p0, p1, p2
    ref[:, :, 1::2, 1::2] = numpy_conv2d(x, w)
    np.testing.assert_allclose(args[-1].numpy(), ref, rtol=1e-5, atol=1e-5)


def _block_names(stmt) -> list[str]:
    """The names of the blocks in a TIR statement tree."""
    if isinstance(stmt, tirx.SeqStmt):
        return [n for child in stmt.seq for n in _block_names(child)]
    names = [stmt.name_hint] if isinstance(stmt, s_tir.SBlock) else []
    for attr in ("block", "body", "init", "then_case", "else_case"):
        child = getattr(stmt, attr, None)
        if isinstance(child, tirx.Stmt):
            names += _block_names(child)
    return names


def test_narrowed_vector_unit():
    """128-bit FMAs on a 256-bit unit: a Zen 1 core (two 128-bit pipes) issues two per cycle
    where it issues one 256-bit FMA; a core with 256-bit pipes issues two of either."""
    zen1 = VectorISA(256, 16, True, fma_units=1, fma_latency=5, fma_pipe_bits=128)
    assert zen1.narrowed(128).fma_units == 2 and zen1.narrowed(128).lanes("float32") == 4
    assert VectorISA(256, 16, True).narrowed(128).fma_units == 2
    assert zen1.narrowed(256) == zen1
