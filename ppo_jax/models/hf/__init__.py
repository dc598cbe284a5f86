"""Hugging Face checkpoints <-> ppo_jax models: the only package that knows Hugging Face names.

Supported architectures (config.json `architectures`):
  causal LMs:    GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                 Qwen3ForCausalLM, Phi3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM,
                 Gemma3ForCausalLM (text)
  reward models: GPT2/Llama/Mistral/Qwen2/Qwen3/Phi3/Gemma/Gemma2 ForSequenceClassification and
                 Gemma3TextForSequenceClassification with num_labels = 1, read into our
                 `ScalarModel` (its `score` head; Hugging Face has no score bias, so it loads as 0).

Weights are read from safetensors only (single file or sharded with `model.safetensors.index.json`);
pickled `.bin`/`.pt` files are refused, nothing is ever unpickled, and `trust_remote_code` is never on.

One module per job; each imports only those above it in this list (no cycles):
  errors          HFModelError
  config_map      config.json <-> ModelConfig (per-family tables, unsupported options refused)
  layouts         TensorMap: HF tensor name / shape / window / axis order of each of our params;
                  the Flax module and abstract params of a checkpoint kind
  safetensors_io  safetensors files: find (single / sharded), memory-map, write, fingerprint
  load            load_config, load_model (straight onto mesh shardings)
  export          export_model (atomic directory write; LoRA adapters merged in on request)
  peft            PEFT LoRA adapter directories: export_adapter, load_adapter
  tokenizers      load_tokenizer, save_tokenizer

Callers use the names re-exported here: `from ppo_jax.models import hf; hf.load_model(...)`.
"""

from ppo_jax.models.hf.config_map import ARCHITECTURES, checkpoint_kind, config_from_hf, config_to_hf
from ppo_jax.models.hf.errors import HFModelError
from ppo_jax.models.hf.export import export_model
from ppo_jax.models.hf.layouts import TensorMap, abstract_params, make_model, tensor_maps
from ppo_jax.models.hf.load import LoadedModel, load_config, load_model
from ppo_jax.models.hf.peft import adapter_lora_config, export_adapter, load_adapter
from ppo_jax.models.hf.safetensors_io import fingerprint
from ppo_jax.models.hf.tokenizers import load_tokenizer, save_tokenizer

__all__ = [
    "ARCHITECTURES", "HFModelError", "LoadedModel", "TensorMap", "abstract_params",
    "adapter_lora_config", "checkpoint_kind", "config_from_hf", "config_to_hf", "export_adapter", "export_model", "fingerprint",
    "load_adapter",
    "load_config", "load_model", "load_tokenizer", "make_model", "save_tokenizer", "tensor_maps",
]
