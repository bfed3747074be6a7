"""Build the Cython cores: the FastCDC chunker ``tb5sync._cdc`` from ``ext/_cdc.pyx`` and the
directory lister ``tb5sync._scan`` from ``ext/_scan.pyx``, the small-file writer
``tb5sync._write`` from ``ext/_write.pyx``, the sender's batch reader of small files
``tb5sync._read`` from ``ext/_read.pyx``, and ``tb5sync._bytes`` (receive buffers
that are ``bytes``, for tb5:// reads) from ``ext/_bytes.pyx``, and the msgpack skimmer
``tb5sync._skim`` (what a peer's payload costs to decode) from ``ext/_skim.pyx``.

Set ``TB5SYNC_REQUIRE_CYTHON=1`` to make a failed extension build fatal (CI does);
otherwise a failed build falls back to the pure-Python twins.
"""
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - only on broken toolchains
            if os.environ.get("TB5SYNC_REQUIRE_CYTHON") == "1":
                raise
            print(f"WARNING: tb5sync._cdc not built ({exc}); using pure Python", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover
            if os.environ.get("TB5SYNC_REQUIRE_CYTHON") == "1":
                raise
            print(f"WARNING: {ext.name} not built ({exc}); using pure Python", file=sys.stderr)


def extensions():
    from Cython.Build import cythonize

    ext = Extension(
        "tb5sync._cdc",
        ["ext/_cdc.pyx"],
        extra_compile_args=["-O3"],
    )
    scan = Extension("tb5sync._scan", ["ext/_scan.pyx"], extra_compile_args=["-O2"])
    write = Extension("tb5sync._write", ["ext/_write.pyx"], extra_compile_args=["-O2"])
    read = Extension("tb5sync._read", ["ext/_read.pyx"], extra_compile_args=["-O2"])
    byt = Extension("tb5sync._bytes", ["ext/_bytes.pyx"], extra_compile_args=["-O2"])
    skim = Extension("tb5sync._skim", ["ext/_skim.pyx"], extra_compile_args=["-O2"])
    return cythonize([ext, scan, write, read, byt, skim], compiler_directives={"language_level": "3"})


# The man pages (`make man` writes them into man/ from the argparse parsers; tests/test_docs.py
# checks that the committed ones match): installed as share/man/man1 under the environment's prefix.
MAN_PAGES = sorted(glob.glob("man/*.1"))

setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt},
      data_files=[("share/man/man1", MAN_PAGES)] if MAN_PAGES else [])
