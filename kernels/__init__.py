"""CUDA kernels: sources (*.cu, *.cuh) and their build (build.py), installed as qoqtool.kernels.

Run from the checkout's root (``python -m pytest``, ``python -m qoqtool``), Python also finds
this folder as a top-level package named ``kernels`` - the name of Hugging Face's kernel hub
package, which transformers >= 5.25 depends on and imports. So when this file is imported under
that name and such a package is installed, it hands the name over to it instead of standing in
for it. (With none installed it stays this folder, a package without a version, which older
transformers, probing for the hub package, take as absent.)
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _module  # what the import statement returns once this file is done
        _spec.loader.exec_module(_module)
