"""CUDA kernels compiled once per machine (kernels/machinery/nvrtc.py): the text, the disk cache, the launch and the
fallback.

On the CPU the compiler and MLX's two CUDA launch functions are stand-ins that record what they are given (this
machine has neither NVRTC nor a CUDA device); the gpu tests compile and launch for real.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.kernels.machinery import dialect, nvrtc
from ds4_mlx.kernels.machinery.nvrtc import CachedKernel, CompileError, CudaCacheWarning, DiskCache, Route


class Compiler:
    """Counts compiles; its "cubin" is the text's bytes, so a read-back can be compared with what was compiled."""

    def __init__(self, fail: bool = False):
        self.compiles: list[str] = []
        self.fail = fail

    def version(self) -> tuple[int, int]:
        return 13, 0

    def compile(self, text: str, function: str, options) -> tuple[bytes, str]:
        self.compiles.append(function)
        if self.fail:
            raise CompileError(f"{function}: error: identifier \"oops\" is undefined")
        return b"\x7fELF\x00" + text.encode(), f"_ZN3mlx4core2cu{len(function)}{function}E"


@pytest.fixture
def use_route(monkeypatch, tmp_path):
    """Makes `nvrtc.route()` answer a Route over a recording compiler in a fresh cache directory."""
    def install(compiler: Compiler, directory=None) -> Route:
        chosen = Route(compiler, ["--gpu-architecture=sm_90a"], DiskCache(directory or tmp_path / "cache"),
                       "nvrtc 13.0")
        nvrtc.route.cache_clear()
        monkeypatch.setattr(nvrtc, "route", lambda: chosen)
        return chosen
    return install


@pytest.fixture
def launches(monkeypatch):
    """Records the launches that reach MLX: ("precompiled" | "mlx", keywords), in order."""
    seen: list[tuple[str, dict]] = []

    def record(kind: str, kw: dict) -> list[mx.array]:
        seen.append((kind, kw))
        return [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: record("precompiled", kw))
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **made: lambda **kw: record("mlx", {**made, **kw}))
    return seen


COPY = dialect.Kernel(name="ds4_test_copy", inputs=("x",), outputs=("y",),
                      source="const int i = GROUP_X * 32 + THREAD_IN_GROUP;\nif (i < N) y[i] = x[i] * SCALE;")


@pytest.fixture
def launch_copy():
    """Launches COPY through one CachedKernel, made for the test as dialect.build makes one for a process."""
    kernel = dialect.CUDA.compile(COPY)

    def launch(x: mx.array, n: int, scale: int = 2) -> mx.array:
        return kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
                      grid=(32 * ((n + 31) // 32), 1, 1), threadgroup=(32, 1, 1),
                      template=[("N", n), ("SCALE", scale)])[0]
    return launch


def test_function_name_follows_mlx():
    assert nvrtc.function_name("ds4_rope", [("A", 512), ("B", True), ("C", False), ("T", mx.float16)]) == \
        "custom_kernel_ds4_rope_512_t_f___half"


def test_kernel_text_lays_out_inputs_outputs_and_constants():
    text = nvrtc.kernel_text("custom_kernel_k_4", "__device__ int helper();\n", "y[0] = x[0];",
                             [("x", mx.float32), ("ids", mx.uint32)], [("y", mx.float16)],
                             [("N", 4), ("FLAG", True), ("T", mx.bfloat16)])
    assert text.startswith(nvrtc.HEADER + "__device__ int helper();\nnamespace mlx::core::cu {")
    assert ("__global__ void custom_kernel_k_4(\n    const float* x,\n    const uint32_t* ids,\n    __half* y) {\n"
            "  constexpr int N = 4;\n  constexpr bool FLAG = true;\n  using T = __nv_bfloat16;\n\ny[0] = x[0];\n}"
            ) in text
    assert text.endswith("} // namespace mlx::core::cu\n")


def test_cache_reads_back_what_it_stored(tmp_path):
    cache = DiskCache(tmp_path / "c")
    assert cache.get("k") is None
    cache.put("k", b"\x00\x01cubin\n\x00", "_Z1kv")
    assert cache.get("k") == (b"\x00\x01cubin\n\x00", "_Z1kv")
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["k.cubin"]  # no partial file left behind


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty"])
def test_a_damaged_cache_file_is_removed_not_used(tmp_path, damage):
    cache = DiskCache(tmp_path)
    cache.put("k", b"0123456789" * 100, "_Z1kv")
    path = cache.path("k")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:-7], "flip": data[:-1] + bytes([data[-1] ^ 1]),
                      "magic": b"x" + data[1:], "empty": b""}[damage])
    assert cache.get("k") is None
    assert not path.exists()


def test_route_compiles_once_per_machine(tmp_path):
    first = Compiler()
    route = Route(first, ["-a"], DiskCache(tmp_path), "nvrtc 13.0")
    cubin, name = route.binary("text one", "f")
    assert route.binary("text one", "f") == (cubin, name)
    assert first.compiles == ["f"]
    again = Compiler()  # a later process: a new compiler over the same directory
    assert Route(again, ["-a"], DiskCache(tmp_path), "nvrtc 13.0").binary("text one", "f") == (cubin, name)
    assert again.compiles == []
    for other in (Route(again, ["-b"], DiskCache(tmp_path), "nvrtc 13.0"),
                  Route(again, ["-a"], DiskCache(tmp_path), "nvrtc 13.1")):
        other.binary("text one", "f")  # other options or another NVRTC: compiled again
    Route(again, ["-a"], DiskCache(tmp_path), "nvrtc 13.0").binary("text two", "f")
    assert again.compiles == ["f", "f", "f"]


def test_a_cache_that_cannot_be_written_still_gives_the_compiled_kernel(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    compiler = Compiler()
    route = Route(compiler, ["-a"], DiskCache(tmp_path / "file" / "cache"), "nvrtc 13.0")
    with pytest.warns(CudaCacheWarning, match="are not kept in") as caught:
        first = route.binary("text one", "f")
        second = route.binary("text two", "g")
    assert first[0].endswith(b"text one") and second[0].endswith(b"text two")
    assert compiler.compiles == ["f", "g"] and route.unstored == 2
    assert len([w for w in caught if w.category is CudaCacheWarning]) == 1


def test_kernel_launches_its_cubin_and_compiles_each_instance_once(use_route, launches, launch_copy):
    compiler = Compiler()
    use_route(compiler)
    x = mx.arange(8, dtype=mx.float32)
    launch_copy(x, 8)
    launch_copy(x, 8)
    launch_copy(x, 8, scale=3)
    launch_copy(x.astype(mx.float16), 8)
    assert [kind for kind, _ in launches] == ["precompiled"] * 4
    assert compiler.compiles == ["custom_kernel_ds4_test_copy_8_2", "custom_kernel_ds4_test_copy_8_3",
                                 "custom_kernel_ds4_test_copy_8_2"]  # the float16 launch is a new instance
    kw = launches[0][1]
    assert kw["name"] == "_ZN3mlx4core2cu31custom_kernel_ds4_test_copy_8_2E"
    assert b"constexpr int SCALE = 2;" in kw["compiled_source"] and b"const float* x" in kw["compiled_source"]
    assert b"const __half* x" in launches[3][1]["compiled_source"]
    assert kw["ensure_row_contiguous"] is True and kw["scalars"] == [] and kw["grid"] == (32, 1, 1)


def test_compile_failure_falls_back_to_mlx_with_one_warning(use_route, launches, launch_copy):
    use_route(Compiler(fail=True))
    x = mx.arange(8, dtype=mx.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch_copy(x, 8)
        launch_copy(x, 8)
    assert [str(w.message) for w in caught if w.category is CudaCacheWarning] == [
        'custom_kernel_ds4_test_copy_8_2 compiles through MLX in every process (custom_kernel_ds4_test_copy_8_2: '
        'error: identifier "oops" is undefined)']
    assert [kind for kind, _ in launches] == ["mlx", "mlx"]
    kw = launches[0][1]
    assert kw["template"] == [("N", 8), ("SCALE", 2)] and kw["name"] == "ds4_test_copy"
    assert "threadIdx.x" in kw["source"] and kw["ensure_row_contiguous"] is True


def test_cache_off_launches_through_mlx_without_a_warning(monkeypatch, launches, launch_copy):
    monkeypatch.setenv(nvrtc.ENV, "off")
    nvrtc.route.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            launch_copy(mx.arange(8, dtype=mx.float32), 8)
    finally:
        nvrtc.route.cache_clear()
    assert [kind for kind, _ in launches] == ["mlx"]


def test_no_cuda_device_means_no_route_and_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv(nvrtc.ENV, str(tmp_path))
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "cpu"})  # what the CPU backend reports
    nvrtc.route.cache_clear()
    try:
        with pytest.warns(CudaCacheWarning, match="compile in every process"):
            assert nvrtc.route() is None
    finally:
        nvrtc.route.cache_clear()


@pytest.mark.parametrize("right", [True, False])
def test_a_new_route_launches_its_probe_before_it_is_used(monkeypatch, tmp_path, right):
    monkeypatch.setenv(nvrtc.ENV, str(tmp_path))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mlx"))
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0})
    compiler = Compiler()
    monkeypatch.setattr(nvrtc.Nvrtc, "load", classmethod(lambda cls: compiler))
    launched = []

    def precompiled(**kw):  # the probe's arithmetic when `right`, else a kernel that wrote nothing
        launched.append(kw["name"])
        return [kw["inputs"][0] * 2 + 1 if right else mx.zeros((32,))]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    nvrtc.route.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = nvrtc.route()
    finally:
        nvrtc.route.cache_clear()
    assert compiler.compiles == ["custom_kernel_ds4_route_probe_32"] and len(launched) == (2 if right else 1)
    assert (chosen is not None) == right
    wrong = ("CUDA kernels compile in every process (no cache: the probe kernel launched from its cubin gave wrong "
             "numbers)")
    assert [str(w.message) for w in caught] == ([] if right else [wrong])
    if right:
        assert chosen.options[0] == "--device-as-default-execution-space"
        assert chosen.options[1] == "--gpu-architecture=sm_90a" and chosen.stamp == "nvrtc 13.0"
        assert chosen.modules == nvrtc.Modules(tmp_path / "mlx")  # the second probe, by handle, passed too


def test_a_route_whose_handles_mlx_cannot_find_passes_whole_cubins(monkeypatch, tmp_path):
    """MLX builds a module from the handle itself where it found no file: that load fails, so whole cubins stay."""
    monkeypatch.setenv(nvrtc.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mlx"))
    monkeypatch.setattr(mx, "device_info", lambda: {"compute_capability_major": 9, "compute_capability_minor": 0})
    monkeypatch.setattr(nvrtc.Nvrtc, "load", classmethod(lambda cls: Compiler()))
    sources = []

    def precompiled(**kw):
        sources.append(kw["compiled_source"])
        if kw["compiled_source"].startswith(b"ds4-mlx module "):
            raise RuntimeError("Failed to load compiled probe kernel")
        return [kw["inputs"][0] * 2 + 1]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    nvrtc.route.cache_clear()
    try:
        with pytest.warns(CudaCacheWarning, match="launch with their whole cubin, which MLX hashes at every launch "
                                                  r"\(Failed to load"):
            chosen = nvrtc.route()
    finally:
        nvrtc.route.cache_clear()
    assert chosen is not None and chosen.modules is None
    assert sources[0].startswith(b"\x7fELF") and sources[1].startswith(b"ds4-mlx module ")


@pytest.mark.parametrize("data, expected", [
    (b"", 0x553E93901E462A6E), (b"a", 0x454DDEE488C1ED6B), (b"abcdefgh", 0x783DB3E38DB898BB),
    (b"abcdefghi", 0xB4EC9257851C8AAF), (b"\x7fELF\x00\xffbinary", 0x73F573DD5437452E),
    (b"ds4-mlx module 0123456789abcdef0123456789abcdef", 0x5849CCB57B6B5DCC)])
def test_std_hash_is_libstdcxx(data, expected):
    """Expected values printed by `std::hash<std::string>{}` of g++ 13's libstdc++ (x86-64), as MLX is built."""
    assert nvrtc.std_hash(data) == expected


def test_module_files_are_named_and_cut_as_mlx_names_them(tmp_path, monkeypatch):
    assert nvrtc.module_file(tmp_path, "_Z1kv_ab12") == tmp_path / "_Z1kv_ab12.ptx"
    long = "x" * 245 + "y" * 245 + "z" * 3
    assert nvrtc.module_file(tmp_path, long) == tmp_path / ("x" * 245) / ("y" * 245) / "zzz.ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    assert nvrtc.mlx_module_directory() == tmp_path / "mine"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(nvrtc.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert nvrtc.mlx_module_directory() == tmp_path / "mlx" / mx.__version__ / "ptx"


def test_a_handle_names_the_module_file_holding_its_cubin(tmp_path):
    modules = nvrtc.Modules(tmp_path)
    cubin = b"\x7fELF" + bytes(range(256)) * 40
    handle = modules.handle(cubin, "_Z1kv")
    assert handle.startswith(b"ds4-mlx module ") and len(handle) < 64
    path = tmp_path / f"_Z1kv_{nvrtc.std_hash(handle):x}.ptx"
    assert path.read_bytes() == cubin and path.with_suffix(".txt").read_bytes() == b"_Z1kv\t_Z1kv\n"
    assert modules.handle(cubin, "_Z1kv") == handle  # found as it is: not written again
    path.write_bytes(cubin[:-1])  # a damaged file would load wrong code: written again
    assert modules.handle(cubin, "_Z1kv") == handle and path.read_bytes() == cubin
    assert modules.handle(cubin + b"\x00", "_Z1kv") != handle
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".ptx", ".ptx", ".txt", ".txt"]  # no partial files


def test_kernels_launch_by_handle_where_the_route_has_modules(use_route, launches, launch_copy, tmp_path):
    chosen = use_route(Compiler())
    chosen.modules = nvrtc.Modules(tmp_path / "mlx")
    launch_copy(mx.arange(8, dtype=mx.float32), 8)
    kw = launches[0][1]
    assert kw["compiled_source"].startswith(b"ds4-mlx module ")
    path = tmp_path / "mlx" / f"{kw['name']}_{nvrtc.std_hash(kw['compiled_source']):x}.ptx"
    assert b"constexpr int SCALE = 2;" in path.read_bytes()


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(nvrtc.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_directory() == tmp_path / "ds4-mlx" / "cuda"
    monkeypatch.setenv(nvrtc.ENV, str(tmp_path / "mine"))
    assert nvrtc.cache_directory() == tmp_path / "mine"
    monkeypatch.setenv(nvrtc.ENV, "OFF")
    assert nvrtc.cache_directory() is None


@pytest.mark.gpu
@pytest.mark.cuda
def test_cached_kernel_equals_mlx_compiled_one_and_is_read_back(on_cuda, monkeypatch, tmp_path, launch_copy):
    monkeypatch.setenv(nvrtc.ENV, str(tmp_path))
    nvrtc.route.cache_clear()
    try:
        route = nvrtc.route()
        assert route is not None, "NVRTC was not found beside MLX"
        assert route.modules is not None, "MLX did not find the probe's module file: kernels pass whole cubins"
        x = mx.random.normal((1000,), key=mx.random.key(1))
        cached = launch_copy(x, 1000, scale=3)
        mlx_made = mx.fast.cuda_kernel(name="ds4_test_copy_mlx", input_names=["x"], output_names=["y"],
                                       source=dialect.CUDA.render(COPY.source))(
            inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(1024, 1, 1), threadgroup=(32, 1, 1),
            template=[("N", 1000), ("SCALE", 3)])[0]
        np.testing.assert_array_equal(np.array(cached), np.array(mlx_made))
        np.testing.assert_array_equal(np.array(cached), np.array(x) * 3)
        assert len(list(tmp_path.glob("*.cubin"))) == 2  # the route's probe (check_route) and this kernel
        compiles = []
        real = route.compiler.compile
        monkeypatch.setattr(route.compiler, "compile", lambda *a: compiles.append(a) or real(*a))
        fresh = CachedKernel(name=COPY.name, input_names=COPY.inputs, output_names=COPY.outputs,
                             source=dialect.CUDA.render(COPY.source), header=dialect.CUDA.header(COPY))
        again = fresh(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(1024, 1, 1),
                      threadgroup=(32, 1, 1), template=[("N", 1000), ("SCALE", 3)])[0]
        np.testing.assert_array_equal(np.array(again), np.array(cached))
        assert compiles == []  # read back from the disk
    finally:
        nvrtc.route.cache_clear()


def test_recording_lists_each_launch_with_its_cubin_dims_and_arrays(use_route, launches, launch_copy):
    use_route(Compiler())
    x = mx.arange(40, dtype=mx.float32)
    outside = launch_copy(x, 40)
    with nvrtc.recording() as recording:
        y = launch_copy(x, 40)
        z = launch_copy(y, 33, scale=3)
        nvrtc.bind(z, x)
    assert not nvrtc.is_recording() and recording.bound == [(z, x)]
    recorded = recording.launches
    assert outside is not y and len(launches) == 3 and len(recorded) == 2
    first, second = recorded
    assert first.inputs[0] is x and first.outputs[0] is y and second.inputs[0] is y and second.outputs[0] is z
    assert first.blocks == (2, 1, 1) and first.block == (32, 1, 1)  # 64 threads for 40 values, 32 a group
    assert first.cubin.startswith(b"\x7fELF") and first.cubin != second.cubin  # each instance's own text
    name = nvrtc.function_name("ds4_test_copy", [("N", 40), ("SCALE", 2)])
    assert first.function == f"_ZN3mlx4core2cu{len(name)}{name}E"  # the lowered name, as the cubin holds it
    assert first.row_contiguous and first.init_value is None
    with nvrtc.recording() as later:
        assert nvrtc.is_recording()
    nvrtc.bind(y, x)  # outside a recording: nothing to note
    # the block ended: nothing more was added
    assert later.launches == [] and len(recorded) == 2 and recording.bound == [(z, x)]


def test_launch_dims_follow_mlx():
    assert nvrtc.launch_dims((1024, 3, 1), (256, 1, 1)) == ((4, 3, 1), (256, 1, 1))
    assert nvrtc.launch_dims((100, 1, 1), (256, 1, 1)) == ((1, 1, 1), (100, 1, 1))  # the block shrinks to the grid
    assert nvrtc.launch_dims((300, 1, 1), (256, 1, 1)) == ((2, 1, 1), (256, 1, 1))
