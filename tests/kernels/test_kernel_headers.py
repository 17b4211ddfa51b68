"""Each header of the CPU kernel compiles alone, and so does every runner in it once instantiated.

paged_attention_cpu.cpp includes all the headers into one translation unit, so a header that leans on
something only an earlier include declares would still build there; here each is compiled on its own
(`-fsyntax-only`, which still instantiates templates) with a few lines that instantiate its runners. The flag
sets are cpu_build's own (every ISA variant, on this CPU), and on x86-64 also explicit targets, so that every
`#if` branch compiles whatever this CPU has: no AVX, AVX2 only, AVX-512 without BF16, with VBMI, with BF16 but
not VBMI, and with both.
"""

from __future__ import annotations

import os
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtune.kernels.cpu_build import FLAGS, INCLUDE_DIR, ISA_FLAGS, _compiler

# Per header, lines that use what it defines (inside the kernel's anonymous namespace), so that its templates
# are instantiated; each is guarded like the header's own contents.
USES = {
    "paged_attention_common.h": """
        void use(const KvtParams& p) {
            std::vector<const Bf16*> rows;
            key_rows(p, p.block_tables, 0, 8, rows);
            Prefetchers<Bf16, kDecodeChunk, 64>(p, rows.data(), 8).step();
        }
    """,
    "cpu_primitives.h": """
        float use(const KvtParams& p, const Fp8* fp8) {
            prefetch_rows<64>(p, fp8, p.block_tables, 0, 4);
            const Item item{0, 0, 0, 1, 0};
            return to_float(Bf16{}) + to_float(F16{}) + to_float(fp8[0]) + fast_exp(1.0f) + item.seq
                + fast_exp16(splat(1.0f))[0] + fast_exp_portable<v16, v16i>(load16(&p.scale))[0];
        }
    """,
    "item_runner.h": """
        template <typename T> void use(const KvtParams& p, const Item& item) {
            Scratch scratch;
            ItemRunner<0, T>(p, scratch).run(item);
            ItemRunner<64, T>(p, scratch).run(item);
        }
        template void use<float>(const KvtParams&, const Item&);
        template void use<F16>(const KvtParams&, const Item&);
        template void use<Bf16>(const KvtParams&, const Item&);
        template void use<Fp8>(const KvtParams&, const Item&);
    """,
    "decode_walk.h": """
        struct Probe {
            void begin(int) {}
            void scores(int, const float* const*, int, Prefetchers<float, kDecodeChunk, 64>& ahead) { ahead.step(); }
            void softmax(int, int) {}
            void values(int, const float* const*, int, Prefetchers<float, kDecodeChunk, 64>&) {}
            void store(const Item&, int) {}
        };
        void use(const KvtParams& p, const Item& item) {
            std::vector<const float*> rows;
            Probe probe;
            run_decode_item<64>(p, item, rows, probe);
        }
    """,
    "decode_runner.h": """
        template <int kDim, int kGroup, typename T> void use(const KvtParams& p, const Item& item) {
            DecodeRunner<kDim, kGroup, T, true>(p).run(item);
            DecodeRunner<kDim, kGroup, T, false>(p).run(item);
        }
        template void use<32, 1, float>(const KvtParams&, const Item&);
        template void use<64, 2, F16>(const KvtParams&, const Item&);
        template void use<128, 4, Bf16>(const KvtParams&, const Item&);
        template void use<64, 8, Fp8>(const KvtParams&, const Item&);
    """,
    "decode_runner_avx2.h": """
        #ifdef __AVX2__
        template <int kDim, int kGroup, typename T> void use(const KvtParams& p, const Item& item) {
            DecodeRunner8<kDim, kGroup, T>(p).run(item);
        }
        template void use<32, 1, float>(const KvtParams&, const Item&);
        template void use<64, 2, F16>(const KvtParams&, const Item&);
        template void use<128, 4, Bf16>(const KvtParams&, const Item&);
        template void use<64, 8, Fp8>(const KvtParams&, const Item&);
        #endif
    """,
    "prefill_runner.h": """
        #ifdef KVT_PREFILL_LANES
        template <int kDim, typename T> void use(const KvtParams& p, const Item& item) {
            if (PrefillRunner<kDim, T>::fits(p)) PrefillRunner<kDim, T, false>(p).run(item);
            PrefillRunner<kDim, T, true>(p).run(item);
        }
        template void use<32, float>(const KvtParams&, const Item&);
        template void use<64, F16>(const KvtParams&, const Item&);
        template void use<128, Bf16>(const KvtParams&, const Item&);
        template void use<64, Fp8>(const KvtParams&, const Item&);
        #endif
    """,
}
HEADERS = sorted(USES)

# Explicit x86-64 targets, each replacing cpu_build's -march=native: no AVX; AVX2 only; AVX-512 without BF16;
# with VBMI; with BF16 but not VBMI; with both.
X86_TARGETS = ["x86-64", "x86-64-v3", "skylake-avx512", "icelake-server", "cooperlake", "sapphirerapids"]


def flag_sets() -> list[tuple[str, tuple[str, ...]]]:
    sets = [(f"cpu_build-{isa}", (*FLAGS, *extra)) for isa, extra in ISA_FLAGS.items()]
    if platform.machine() in {"x86_64", "AMD64"}:
        for march in X86_TARGETS:
            flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)
            sets.append((f"march={march}", flags))
    return sets


FLAG_SETS = flag_sets()


def test_every_kernel_header_is_listed() -> None:
    assert {path.name for path in INCLUDE_DIR.glob("*.h")} == set(HEADERS)


@pytest.mark.parametrize("flags", [flags for _, flags in FLAG_SETS], ids=[name for name, _ in FLAG_SETS])
def test_each_header_compiles_alone(flags: tuple[str, ...]) -> None:
    compiler = _compiler()

    def check(header: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [compiler, *flags, "-fsyntax-only", f"-I{INCLUDE_DIR}", "-x", "c++", "-"],
            input=f'#include "{header}"\nnamespace {{\n{USES[header]}\n}}  // namespace\n',
            capture_output=True,
            text=True,
            check=False,
        )

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for header, done in zip(HEADERS, pool.map(check, HEADERS), strict=True):
            assert done.returncode == 0, f"{header} with {' '.join(flags)}:\n{done.stderr}"
