from __future__ import annotations

import subprocess
import sys

import tidal.kernels


def test_importing_the_package_does_not_import_triton():
    # the CPU engine imports tidal.kernels for HAS_TRITON and must not pay for (or need) triton
    code = "import sys, tidal.kernels; print(tidal.kernels.HAS_TRITON); assert 'triton' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_package_attributes_are_the_functions_even_after_their_modules_load():
    import tidal.kernels.decode_attention
    import tidal.kernels.norm

    assert tidal.kernels.paged_decode_attention is tidal.kernels.decode_attention.paged_decode_attention
    assert tidal.kernels.rms_norm is tidal.kernels.norm.rms_norm
    assert tidal.kernels.rotary_embedding_reference.__name__ == "rotary_embedding_reference"
