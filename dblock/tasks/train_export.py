"""Exporting a trained model: the HF folder of a `dblock train-tiny` run, written all or nothing, with its tokenizer
and the run's own files carried over (never stale weights)."""
from __future__ import annotations

import os
import shutil
from typing import Optional


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name == "model.safetensors.index.json"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def export(model, out: str, tok, extra: Optional[dict] = None, carry_from: Optional[str] = None,
           overwrite: bool = False, storage_dtype: Optional[str] = None) -> None:
    """The HF folder `out`, written all or nothing (`dblock.weights_write.staged_folder`): config.json + model.safetensors
    (+ the files transformers reads, e.g. DiffusionGemma's generation_config.json), tokenizer.json +
    tokenizer_config.json and `extra` ({name: text}).

    `carry_from`: a folder whose other entries (the run's train_state.st, a model card) are carried into the new
    folder -- never weights (*.safetensors, the index) nor anything the export writes itself, nor *.tmp leftovers.
    `out` must be missing or empty unless `overwrite` (then the whole folder is replaced)."""
    from dblock.tiny import hf_files
    from dblock.weights_write import staged_folder, write_model
    model.eval()
    with staged_folder(out, overwrite) as tmp:
        write_model(model, tmp, extra_files={**hf_files(model), **(extra or {})}, storage_dtype=storage_dtype)
        tok.save(tmp)
        if carry_from is not None and os.path.isdir(carry_from):
            for name in sorted(os.listdir(carry_from)):
                src, dst = os.path.join(carry_from, name), os.path.join(tmp, name)
                if _is_weights(name) or name.endswith(".tmp") or os.path.lexists(dst):
                    continue
                if os.path.islink(src):
                    os.symlink(os.readlink(src), dst)
                elif os.path.isdir(src):
                    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(src, dst)
