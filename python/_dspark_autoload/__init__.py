"""The ``torch.backends`` autoload hook of the dspark package.

torch runs every entry point of the group ``torch.backends`` at ``import torch``, and an
exception there makes ``import torch`` itself fail. So this hook lives in its own tiny
package (importing it does not import dspark's native module), does nothing on torch >= 2.14
(whose ``torch.distributed.backends`` entry point registers dspark lazily, the first time
the name is asked for), and never raises. ``DSPARK_TORCH_AUTOLOAD=0`` turns it off.
"""


def hook():
    try:
        import os
        import sys

        if os.environ.get("DSPARK_TORCH_AUTOLOAD", "1") == "0":
            return
        version = getattr(sys.modules.get("torch"), "__version__", "")
        parts = version.split("+")[0].split(".")
        try:
            if (int(parts[0]), int(parts[1])) >= (2, 14):
                return
        except (ValueError, IndexError):
            pass
        if "dspark.torch" in sys.modules:
            # dspark.torch is being imported and imported torch (``import dspark.torch``
            # before ``import torch``): it registers the backend itself when it ends. Importing
            # it again here would find it half-initialised.
            return
        import dspark.torch

        dspark.torch.register()
    except Exception as e:  # never break `import torch`
        try:
            import warnings

            warnings.warn(
                f"dspark: the torch backend was not registered at import torch ({e!r}); "
                "`import dspark.torch` registers it explicitly",
                RuntimeWarning,
                stacklevel=2,
            )
        except Exception:
            pass
