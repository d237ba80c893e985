"""The Megatron contract: every Megatron internal the glue, the lab's CPU harness and the doctor rely on.

Data only (checked by ``tests/megatron/test_contract.py`` against the installed megatron-core, no model built).
Each :class:`Entry` names a ``target`` (a dotted path: a module, or a class / function / method in one) and
``names`` on it, whose meaning follows ``kind``:

* ``attribute``: attributes of the target that we read or replace;
* ``callable``: parameters of the target's signature that we call with (by keyword) or mirror;
* ``class-field``: fields of the target class we read or set (dataclass fields, class attributes, or
  attributes its methods assign on ``self``);
* ``hook-arguments``: parameters a wrapper of the target binds by name (``inspect.signature(...).bind``; none
  where the wrapper reads only the return value);
* ``argument``: destinations of Megatron-LM's command-line arguments (the target adds them to a parser).

``users``: who relies on it (``glue``, ``lab-cpu``, ``doctor``, with the file). ``releases``: the megatron-core
releases the entry exists on where it is not all supported ones (``"<0.19"``, ``">=0.19"``), else empty. This
table and :mod:`megatron_ring.megatron.compat` are the only places that know releases.

Each entry is either part of Megatron's **interface**, used as Megatron offers it (:data:`INTERFACE`), or an
**internal**. The interface is what a module or a script is meant to plug into or drive: the core-attention
interface a spec swaps in (``DotProductAttention``'s constructor and ``forward``, ``AttnMaskType``,
``MegatronModule``); the spec system (``ModuleSpec``, ``build_module``, the ``*Submodules`` dataclasses, the
layer / block / stack spec builders and the module classes specs name); the config and argument records
(``TransformerConfig``, ``PackedSeqParams``, ``ProcessGroupCollection``); ``parallel_state``'s group API; the
public utilities Megatron's own scripts and modules call (``get_batch_on_this_cp_rank``, RoPE,
``get_cuda_rng_tracker``, the sharded-state-dict helper); the version; Megatron-LM's flags and ``pretrain``.
Everything else is internal: a private name, an attribute replaced, a module attribute or object field reached
from outside, a Megatron-LM training internal, a hook. ``tests/megatron/test_contract.py`` checks the rules an
interface entry must meet (no private name, nothing replaced, no hook) and counts internals per user
(:func:`counts`).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Entry", "CONTRACT", "KINDS", "INTERFACE", "counts"]

KINDS = ("attribute", "callable", "class-field", "hook-arguments", "argument")


class Entry(NamedTuple):
    name: str
    target: str
    kind: str
    names: tuple[str, ...]
    users: tuple[str, ...]
    releases: str = ""


_MC = "megatron.core"
_TC = f"{_MC}.transformer.transformer_config.TransformerConfig"
_PS = f"{_MC}.parallel_state"
_RANDOM = f"{_MC}.tensor_parallel.random"
_SPECS = f"{_MC}.models.gpt.gpt_layer_specs"
_ROPE = f"{_MC}.models.common.embeddings"
_LOCAL_SPEC_ARGS = ("num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention", "fp8",
                    "normalization", "qk_l2_norm")

CONTRACT: tuple[Entry, ...] = (
    # ---- core attention: RingDotProductAttention stands where DotProductAttention is built and called
    Entry("core-attention-init", f"{_MC}.transformer.dot_product_attention.DotProductAttention.__init__",
          "callable", ("config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
                       "softmax_scale", "cp_comm_type", "pg_collection"), ("glue: attention/module.py",)),
    Entry("core-attention-forward", f"{_MC}.transformer.dot_product_attention.DotProductAttention.forward",
          "callable", ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
                       "packed_seq_params"), ("glue: attention/module.py",)),
    Entry("attn-mask-types", f"{_MC}.transformer.enums.AttnMaskType", "attribute", ("causal", "no_mask"),
          ("glue: attention/module.py",)),
    Entry("megatron-module", f"{_MC}.transformer.module.MegatronModule.__init__", "callable", ("config",),
          ("glue: attention/module.py",)),
    Entry("transformer-config", _TC, "class-field",
          ("attention_dropout", "context_parallel_size", "deterministic_mode", "mtp_num_layers", "kv_channels",
           "num_attention_heads", "num_query_groups", "qk_clip", "log_max_attention_logit", "tensor_model_parallel_size", "window_size",
           "window_attn_skip_freq", "softmax_type", "use_cpu_initialization", "params_dtype",
           "perform_initialization", "init_method", "cp_comm_type", "transformer_impl",
           "experimental_attention_variant", "use_kitchen", "num_moe_experts", "qk_l2_norm", "normalization",
           "qk_layernorm", "multi_latent_attention", "heterogeneous_block_specs", "hidden_size",
           "layernorm_epsilon"),
          ("glue: attention/module.py, attention/sinks.py, spec/gpt.py, spec/deferred.py, spec/hybrid.py",)),
    Entry("packed-seq-params", f"{_MC}.packed_seq_params.PackedSeqParams", "class-field",
          ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
           "max_seqlen_q", "max_seqlen_kv", "cp_group", "local_cp_size"),
          ("glue: data/documents.py, data/hybrid_cp.py, data/packed_rope.py, groups/resolve.py",)),
    Entry("process-group-collection", f"{_MC}.process_groups_config.ProcessGroupCollection", "class-field",
          ("tp", "cp", "pp", "dp_cp"), ("glue: attention/module.py, groups/provider.py, groups/resolve.py",)),
    Entry("use-mpu-process-groups", f"{_MC}.process_groups_config.ProcessGroupCollection.use_mpu_process_groups",
          "callable", ("required_pgs",), ("glue: attention/module.py",)),
    Entry("window-attention", f"{_MC}.transformer.utils.is_layer_window_attention", "callable",
          ("window_size", "window_attn_skip_freq", "layer_number"), ("glue: attention/module.py",)),
    Entry("rng-tracker", f"{_MC}.tensor_parallel", "attribute", ("get_cuda_rng_tracker",),
          ("glue: attention/dropout.py",)),
    Entry("sharded-tensors", f"{_MC}.transformer.utils.make_sharded_tensors_for_checkpoint", "callable",
          ("state_dict", "prefix", "tensor_parallel_layers_axis_map", "sharded_offsets", "tp_group", "dp_cp_group"),
          ("glue: attention/sinks.py", "lab-cpu: cpu/ssm.py")),
    Entry("dp-cp-metadata", f"{_MC}.transformer.utils.ensure_metadata_has_dp_cp_group", "callable", ("metadata",),
          ("glue: attention/sinks.py",)),
    # ---- layer specs
    Entry("module-spec", f"{_MC}.transformer.spec_utils.ModuleSpec", "class-field", ("module", "params", "submodules"),
          ("glue: spec/*.py",)),
    Entry("build-module", f"{_MC}.transformer.spec_utils.build_module", "callable", ("spec_or_module",),
          ("glue: spec/deferred.py",)),
    Entry("base-transformer-layer", f"{_MC}.transformer.transformer_layer", "attribute", ("BaseTransformerLayer",),
          ("glue: spec/deferred.py",)),
    Entry("layer-submodules", f"{_MC}.transformer.transformer_layer.TransformerLayerSubmodules", "class-field",
          ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"), ("glue: spec/hybrid.py",)),
    Entry("self-attention-submodules", f"{_MC}.transformer.attention.SelfAttentionSubmodules", "class-field",
          ("core_attention",), ("glue: spec/layers.py, spec/stock.py",)),
    Entry("attention-classes", f"{_MC}.transformer.attention", "attribute", ("Attention", "CrossAttention",
                                                                             "SelfAttention"),
          ("glue: spec/layers.py", "doctor: doctor/capture.py")),
    Entry("block-submodules", f"{_MC}.transformer.transformer_block.TransformerBlockSubmodules", "class-field",
          ("layer_specs", "layer_norm"), ("glue: spec/deferred.py",)),
    Entry("block-layer-norm", f"{_MC}.transformer.transformer_block", "attribute", ("LayerNormImpl",),
          ("glue: spec/deferred.py",)),
    Entry("layers-to-build", f"{_MC}.transformer.transformer_block.get_num_layers_to_build", "callable",
          ("config", "vp_stage", "pp_rank"), ("glue: spec/deferred.py",)),
    Entry("local-spec", f"{_SPECS}.get_gpt_layer_local_spec", "callable",
          (*_LOCAL_SPEC_ARGS, "moe_use_legacy_grouped_gemm"), ("glue: compat.py, spec/layers.py, spec/gpt.py",),
          "<0.19"),
    Entry("local-submodules", f"{_SPECS}.get_gpt_layer_local_submodules", "callable", _LOCAL_SPEC_ARGS,
          ("glue: compat.py",), ">=0.19"),
    Entry("te-spec", f"{_SPECS}.get_gpt_layer_with_transformer_engine_spec", "callable",
          ("num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention", "qk_l2_norm"),
          ("glue: spec/gpt.py",)),
    Entry("decoder-block-spec", f"{_SPECS}.get_gpt_decoder_block_spec", "callable",
          ("config", "use_transformer_engine", "normalization", "qk_l2_norm", "vp_stage", "pp_rank"),
          ("glue: spec/gpt.py",)),
    Entry("heterogeneous-config", f"{_MC}.transformer.heterogeneous.heterogeneous_config", "attribute",
          ("HeterogeneousTransformerConfig",), ("glue: spec/gpt.py",)),
    Entry("heterogeneous-spec", f"{_MC}.models.gpt.heterogeneous.heterogeneous_layer_specs"
          ".get_gpt_heterogeneous_layer_spec", "callable", ("config", "use_te"), ("glue: spec/gpt.py",)),
    Entry("moe-module-spec", f"{_MC}.models.gpt.moe_module_specs.get_moe_module_spec", "callable",
          ("use_te", "num_experts", "moe_grouped_gemm"), ("glue: compat.py",)),
    Entry("local-norm", f"{_MC}.transformer.torch_norm.WrappedTorchNorm", "callable",
          ("config", "hidden_size", "eps"), ("glue: compat.py, spec/hybrid.py",)),
    Entry("local-linears", f"{_MC}.tensor_parallel.layers", "attribute", ("ColumnParallelLinear", "RowParallelLinear"),
          ("glue: spec/hybrid.py",)),
    Entry("local-core-attention", f"{_MC}.transformer.dot_product_attention", "attribute", ("DotProductAttention",),
          ("glue: spec/hybrid.py",)),
    Entry("te-modules", f"{_MC}.extensions.transformer_engine", "attribute",
          ("HAVE_TE", "TEColumnParallelLinear", "TELayerNormColumnParallelLinear", "TERowParallelLinear", "TELinear",
           "TENorm", "TEDotProductAttention"), ("glue: compat.py, spec/hybrid.py",)),
    Entry("version", f"{_MC}.package_info", "attribute", ("MAJOR", "MINOR", "PATCH"),
          ("glue: compat.py", "doctor: doctor/static.py")),
    # ---- hybrid (Mamba / GDN) stack
    Entry("hybrid-stack", f"{_MC}.models.hybrid.hybrid_block.HybridStack", "callable",
          ("config", "submodules", "layer_type_list", "pp_layer_offset", "post_layer_norm", "post_process",
           "is_mtp_layer"), ("glue: compat.py, spec/hybrid.py",), ">=0.19"),
    Entry("hybrid-stack-fields", f"{_MC}.models.hybrid.hybrid_block.HybridStack", "class-field",
          ("final_norm", "post_layer_norm", "layer_type_list"), ("glue: spec/hybrid.py",), ">=0.19"),
    Entry("hybrid-stack-submodules", f"{_MC}.models.hybrid.hybrid_block.HybridStackSubmodules", "class-field",
          ("dsa_layer", "moe_layer"), ("glue: spec/hybrid.py",), ">=0.19"),
    Entry("hybrid-stack-spec", f"{_MC}.models.hybrid.hybrid_layer_specs", "attribute", ("hybrid_stack_spec",),
          ("glue: compat.py",), ">=0.19"),
    Entry("mamba-stack", f"{_MC}.ssm.mamba_block.MambaStack", "callable",
          ("config", "submodules", "post_layer_norm", "post_process"), ("glue: compat.py, spec/hybrid.py",), "<0.19"),
    Entry("mamba-stack-spec", f"{_MC}.models.mamba.mamba_layer_specs", "attribute", ("mamba_stack_spec",),
          ("glue: compat.py",), "<0.19"),
    Entry("mamba-layer-submodules", f"{_MC}.ssm.mamba_layer.MambaLayerSubmodules", "class-field", ("norm", "mixer"),
          ("glue: spec/hybrid.py",)),
    # ---- batches, RoPE, MTP, groups
    Entry("megatron-cp-split", f"{_MC}.utils.get_batch_on_this_cp_rank", "callable", ("batch", "cp_group"),
          ("glue: compat.py",)),
    Entry("megatron-cp-split-hybrid", f"{_MC}.utils.get_batch_on_this_cp_rank", "callable", ("is_hybrid_cp",),
          ("glue: compat.py",), ">=0.19"),
    Entry("thd-partitioner-users", f"{_MC}.utils", "attribute", ("tex", "is_te_min_version"),
          ("glue: compat.py, data/token_order.py",)),
    Entry("thd-partitioner-users-mamba", f"{_MC}.ssm.mamba_context_parallel", "attribute",
          ("tex", "is_te_min_version"), ("glue: compat.py, data/token_order.py",)),
    Entry("rotary-embedding", f"{_ROPE}.rotary_pos_embedding.RotaryEmbedding.forward", "callable",
          ("max_seq_len", "offset", "packed_seq", "cp_group"), ("glue: data/rope.py",)),
    Entry("rotary-embedding-fields", f"{_ROPE}.rotary_pos_embedding.RotaryEmbedding", "class-field",
          ("get_emb", "cp_group", "get_freqs_non_repeated", "rotary_interleaved"),
          ("glue: data/rope.py, data/packed_rope.py", "lab-cpu: cpu/core.py")),
    Entry("apply-rope", f"{_ROPE}.rope_utils.apply_rotary_pos_emb", "callable",
          ("t", "freqs", "config", "cu_seqlens", "cp_group"), ("glue: data/packed_rope.py",)),
    Entry("mtp-roll-tensor", f"{_MC}.transformer.multi_token_prediction.roll_tensor", "callable",
          ("tensor", "shifts", "dims", "cp_group", "packed_seq_params"), ("glue: compat.py, data/mtp_loss.py",)),
    Entry("mtp-roll-tensor-gpt", f"{_MC}.models.gpt.gpt_model.roll_tensor", "callable",
          ("tensor", "shifts", "dims", "cp_group", "packed_seq_params"), ("glue: compat.py, data/mtp_loss.py",),
          "<0.19"),
    Entry("parallel-state", _PS, "attribute",
          ("model_parallel_is_initialized", "initialize_model_parallel", "destroy_model_parallel",
           "get_context_parallel_group", "get_context_parallel_world_size", "get_tensor_model_parallel_group",
           "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
           "get_tensor_model_parallel_rank", "get_pipeline_model_parallel_group",
           "get_pipeline_model_parallel_world_size", "get_data_parallel_group", "get_data_parallel_world_size",
           "get_hybrid_data_context_parallel_groups"),
          ("glue: groups/provider.py, groups/resolve.py, data/hybrid_cp.py, data/loss.py",)),
    Entry("parallel-state-ranks", _PS, "attribute",
          ("get_context_parallel_rank", "get_pipeline_model_parallel_rank", "get_data_parallel_rank"),
          ("doctor: doctor/capture.py",)),
    Entry("initialize-model-parallel", f"{_PS}.initialize_model_parallel", "callable",
          ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
          ("glue: groups/provider.py",)),
    Entry("cp-group", f"{_PS}.get_context_parallel_group", "callable", ("check_initialized",),
          ("glue: groups/resolve.py",)),
    Entry("dp-group", f"{_PS}.get_data_parallel_group", "callable", ("with_context_parallel",),
          ("glue: groups/provider.py, data/loss.py",)),
    Entry("dp-size", f"{_PS}.get_data_parallel_world_size", "callable", ("with_context_parallel",),
          ("glue: groups/provider.py, data/loss.py",)),
    Entry("hybrid-cp-groups", f"{_PS}.get_hybrid_data_context_parallel_groups", "callable", ("group_size",),
          ("glue: groups/resolve.py",)),
    Entry("balanced-cp-scheduler", f"{_MC}.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler", "callable",
          ("max_seq_len_per_rank", "dp_cp_group"), ("glue: groups/dynamic_cp.py",)),
    Entry("balanced-cp-groups", f"{_MC}.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler"
          ".get_groups_and_subsamples", "callable", ("sample_id_seqlens", "config"), ("glue: groups/dynamic_cp.py",)),
    Entry("hybrid-cp-wrapper", f"{_MC}.datasets.data_schedule.HybridCPDataLoaderWrapper", "class-field",
          ("cp_balancing_scheduler", "dp_cp_group"), ("glue: groups/dynamic_cp.py",)),
    # ---- Megatron-LM (megatron.training: in the megatron-core wheel from 0.19)
    Entry("lm-global-args", "megatron.training.global_vars", "attribute", ("_GLOBAL_ARGS",), ("glue: compat.py",)),
    Entry("lm-pretrain", "megatron.training.training.pretrain", "callable",
          ("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func", "model_provider"),
          ("glue: compat.py",)),
    Entry("lm-parse-args", "megatron.training.arguments.parse_and_validate_args", "callable",
          ("extra_args_provider", "args_defaults"), ("glue: compat.py",)),
    Entry("lm-cfg-container", "megatron.training.argument_utils.pretrain_cfg_container_from_args", "callable",
          ("args", "model_cfg"), ("glue: compat.py",)),
    Entry("lm-default-layer-spec", "megatron.training.models.gpt.default_layer_spec", "callable",
          ("config", "vp_stage"), ("glue: compat.py, spec/megatron_lm.py",)),
    Entry("lm-mtp-block-spec", "megatron.training.models.gpt.mtp_block_spec", "callable", ("config",),
          ("glue: compat.py, spec/mtp.py",)),
    Entry("lm-gpt-model-config", "megatron.training.models.gpt.GPTModelConfig", "class-field",
          ("transformer", "transformer_layer_spec", "pre_wrap_hooks"), ("glue: compat.py, spec/megatron_lm.py",)),
    Entry("lm-script-mtp-block-spec", "gpt_builders.get_gpt_mtp_block_spec", "callable", ("config",),
          ("glue: compat.py, spec/mtp.py",)),
    Entry("lm-arguments", "megatron.training.arguments.add_megatron_arguments", "argument",
          ("context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes",
           "tensor_model_parallel_size", "pipeline_model_parallel_size", "seq_length", "attention_dropout",
           "num_layers", "mtp_num_layers", "attention_backend", "dataloader_inter_document_masking", "sft",
           "position_embedding_type"),
          ("glue: config.py, compat.py, spec/megatron_lm.py, data/token_order.py",)),
    # ---- the lab's CPU harness (lab/megatron_ring_lab/cpu)
    Entry("cpu-memory-buffer", f"{_MC}.utils.GlobalMemoryBuffer.get_tensor", "callable",
          ("tensor_shape", "dtype", "name", "mem_alloc_context"), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-memory-buffer-field", f"{_MC}.utils.GlobalMemoryBuffer", "class-field", ("buffer",),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-causal-mask", f"{_MC}.transformer.utils.get_default_causal_mask", "callable", ("sq",),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-causal-mask-softmax", f"{_MC}.fusions.fused_softmax", "attribute", ("get_default_causal_mask",),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rope-emb", f"{_ROPE}.rotary_pos_embedding.RotaryEmbedding.get_emb", "callable",
          ("max_seq_len", "offset"), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-pos-emb-slice", f"{_ROPE}.rope_utils.get_pos_emb_on_this_cp_rank", "callable",
          ("pos_emb", "seq_dim", "cp_group"), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-pos-emb-slice-users", f"{_ROPE}.rotary_pos_embedding", "attribute", ("get_pos_emb_on_this_cp_rank",),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-pos-emb-slice-yarn", f"{_ROPE}.yarn_rotary_pos_embedding", "attribute",
          ("get_pos_emb_on_this_cp_rank",), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rng-module", _RANDOM, "attribute",
          ("CudaRNGStatesTracker", "_MODEL_PARALLEL_RNG_TRACKER_NAME", "_CUDA_RNG_STATE_TRACKER",
           "_CUDA_RNG_STATE_TRACKER_INITIALIZED", "_get_cuda_rng_state", "_set_cuda_rng_state"),
          ("lab-cpu: cpu/core.py, cpu/training.py",)),
    Entry("cpu-rng-init", f"{_RANDOM}.initialize_rng_tracker", "callable", (),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rng-tracker", f"{_RANDOM}.CudaRNGStatesTracker", "callable",
          ("use_cudagraphable_rng", "is_inference_rng_tracker"), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rng-tracker-fields", f"{_RANDOM}.CudaRNGStatesTracker", "class-field",
          ("add", "fork", "states_", "seeds_", "_is_initialized"), ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rng-tracker-add", f"{_RANDOM}.CudaRNGStatesTracker.add", "callable", ("name", "seed"),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-rng-tracker-fork", f"{_RANDOM}.CudaRNGStatesTracker.fork", "callable", ("name",),
          ("lab-cpu: cpu/core.py",)),
    Entry("cpu-lm-initialize", "megatron.training.training.initialize_megatron", "callable", ("allow_no_cuda",),
          ("lab-cpu: cpu/training.py",)),
    Entry("cpu-lm-replaced", "megatron.training.initialize", "attribute",
          ("_initialize_distributed", "_set_random_seed", "_compile_dependencies"), ("lab-cpu: cpu/training.py",)),
    Entry("cpu-lm-jit", "megatron.training.training", "attribute", ("set_jit_fusion_options",),
          ("lab-cpu: cpu/training.py",)),
    Entry("cpu-lm-clip-qk", "megatron.training.training", "attribute", ("clip_qk",),
          ("lab-cpu: cpu/training.py (fp32 chunks handed to clip_qk as it walks them: chunk.module.module)",)),
    Entry("cpu-lm-device-arch", "megatron.training.arguments", "attribute", ("get_device_arch_version",),
          ("lab-cpu: cpu/training.py",)),
    Entry("cpu-lm-te-check", "megatron.training.arguments", "attribute", ("is_te_min_version",),
          ("lab-cpu: cpu/training.py (--qk-clip's TE >= 2.9 check, answered by compat.qk_clip_te_check)",)),
    Entry("qk-clip", f"{_MC}.optimizer.qk_clip.clip_qk", "callable", ("model", "log_max_only"),
          ("glue: compat.py, attention/qk_clip.py (clip_qk reads core_attention.current_max_attn_logits; "
           "compat.qk_clip_passes_layers_without_attention calls it on a stand-in model)",)),
    Entry("cpu-mamba-mixer", f"{_MC}.ssm.mamba_mixer", "attribute",
          ("HAVE_MAMBA_SSM", "ExtendedRMSNorm", "causal_conv1d_fn", "MambaMixer"), ("lab-cpu: cpu/ssm.py",)),
    Entry("cpu-mamba-mixer-init", f"{_MC}.ssm.mamba_mixer.MambaMixer", "class-field", ("__init__",),
          ("lab-cpu: cpu/ssm.py",)),
    Entry("cpu-mamba-mixer-kernels", f"{_MC}.ssm.mamba_mixer", "attribute",
          ("mamba_split_conv1d_scan_combined", "mamba_chunk_scan_combined", "_check_mamba_sequence_packing_support"),
          ("lab-cpu: cpu/ssm.py",), ">=0.19"),
    Entry("cpu-gdn-common", f"{_MC}.ssm.gated_delta_net.common", "attribute",
          ("HAVE_FLA", "l2norm", "causal_conv1d", "chunk_gated_delta_rule"), ("lab-cpu: cpu/ssm.py",), ">=0.19"),
    Entry("cpu-gdn-kernels", f"{_MC}.ssm.gated_delta_net.gdn", "attribute", ("causal_conv1d", "chunk_gated_delta_rule"),
          ("lab-cpu: cpu/ssm.py",), ">=0.19"),
    Entry("cpu-gdn", f"{_MC}.ssm.gated_delta_net.gdn.GatedDeltaNet", "class-field",
          ("__init__", "reset_parameters", "forward"), ("lab-cpu: cpu/ssm.py",), ">=0.19"),
    Entry("cpu-gdn-base", f"{_MC}.ssm.gated_delta_net.common._GDNBase", "class-field",
          ("__init__", "reset_parameters", "forward", "_apply_gated_norm", "_compute_g_and_beta",
           "_prepare_input_for_gated_delta_rule"), ("lab-cpu: cpu/ssm.py",), ">=0.19"),
    Entry("cpu-gdn-module", f"{_MC}.ssm.gated_delta_net", "attribute",
          ("HAVE_FLA", "chunk_gated_delta_rule", "GatedDeltaNet"), ("lab-cpu: cpu/ssm.py",), "<0.19"),
    Entry("cpu-gdn-module-class", f"{_MC}.ssm.gated_delta_net.GatedDeltaNet", "class-field",
          ("__init__", "reset_parameters", "forward", "_apply_gated_norm"), ("lab-cpu: cpu/ssm.py",), "<0.19"),
    Entry("cpu-torch-cuda", "torch.cuda", "attribute",
          ("Stream", "Event", "synchronize", "current_device", "current_stream", "default_stream", "stream",
           "set_stream", "empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved",
           "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated", "memory_stats",
           "manual_seed", "manual_seed_all", "ipc_collect", "get_rng_state", "set_rng_state", "device_count",
           "set_device"), ("lab-cpu: cpu/training.py, cpu/ssm.py",)),
    # ---- the doctor's hooks (lab/megatron_ring_lab/doctor/capture.py)
    Entry("doctor-train-step", "megatron.training.training.train_step", "hook-arguments",
          ("forward_step_func", "data_iterator", "model", "optimizer", "forward_backward_func"),
          ("doctor: doctor/capture.py",)),
    Entry("doctor-evaluate", "megatron.training.training.evaluate", "hook-arguments", (),
          ("doctor: doctor/capture.py",)),  # wrapped for its return value only: no argument read
    Entry("doctor-forward-backward", f"{_MC}.pipeline_parallel.schedules.forward_backward_no_pipelining",
          "hook-arguments", ("forward_only",), ("doctor: doctor/capture.py",)),
    Entry("doctor-mtp-reporter", f"{_MC}.transformer.multi_token_prediction.MTPLossLoggingHelper.track_mtp_metrics",
          "hook-arguments", ("total_loss_dict",), ("doctor: doctor/capture.py",)),
    Entry("doctor-moe-tracker", f"{_MC}.transformer.moe.moe_utils", "attribute", ("get_moe_metrics_tracker",),
          ("doctor: doctor/capture.py",), ">=0.19"),
    Entry("doctor-moe-reporter", f"{_MC}.transformer.moe.moe_logging.MoEMetricsTracker.report", "hook-arguments",
          ("total_loss_dict",), ("doctor: doctor/capture.py",), ">=0.19"),
    Entry("doctor-model-forward", f"{_MC}.models.gpt.gpt_model.GPTModel.forward", "hook-arguments",
          ("input_ids", "position_ids", "attention_mask", "labels", "packed_seq_params"),
          ("doctor: doctor/capture.py",)),
    Entry("doctor-attention-forward", f"{_MC}.transformer.attention.SelfAttention.forward", "hook-arguments",
          ("rotary_pos_emb",), ("doctor: doctor/capture.py",)),
    Entry("doctor-layer-number", f"{_MC}.transformer.transformer_layer.TransformerLayer", "class-field",
          ("layer_number",), ("doctor: doctor/capture.py",)),
    Entry("doctor-get-args", "megatron.training", "attribute", ("get_args",), ("doctor: doctor/capture.py",)),
    Entry("doctor-arguments", "megatron.training.arguments.add_megatron_arguments", "argument",
          ("seq_length", "train_iters", "num_layers", "hidden_size", "ffn_hidden_size", "global_batch_size", "lr",
           "hidden_dropout", "attention_dropout", "clip_grad"), ("doctor: doctor/capture.py",)),
)

#: entries that are Megatron's interface, used as offered (module docstring); every other entry is an internal
INTERFACE: frozenset[str] = frozenset({
    # the core-attention interface a spec swaps in
    "core-attention-init", "core-attention-forward", "attn-mask-types", "megatron-module",
    # config and argument records
    "transformer-config", "heterogeneous-config", "packed-seq-params", "process-group-collection",
    "use-mpu-process-groups",
    # the spec system: specs, submodule records, builders, the module classes specs name
    "module-spec", "build-module", "base-transformer-layer", "layer-submodules", "self-attention-submodules",
    "attention-classes", "block-submodules", "local-spec", "local-submodules", "te-spec", "decoder-block-spec",
    "heterogeneous-spec", "moe-module-spec", "local-norm", "local-linears", "local-core-attention", "te-modules",
    "hybrid-stack", "hybrid-stack-submodules", "hybrid-stack-spec", "mamba-stack", "mamba-stack-spec",
    "mamba-layer-submodules",
    # parallel_state's group API
    "parallel-state", "parallel-state-ranks", "initialize-model-parallel", "cp-group", "dp-group", "dp-size",
    "hybrid-cp-groups",
    # public utilities Megatron's own scripts and modules call
    "megatron-cp-split", "megatron-cp-split-hybrid", "rotary-embedding", "apply-rope", "rng-tracker",
    "sharded-tensors",
    # the version, Megatron-LM's flags and its entry point
    "version", "lm-arguments", "doctor-arguments", "lm-pretrain",
})


def counts(user: str) -> dict[str, int]:
    """Entries and names of the contract one user (``glue``, ``lab-cpu``, ``doctor``) relies on: all of them, and
    the internals among them (entries not in :data:`INTERFACE`)."""
    mine = [e for e in CONTRACT if any(u.startswith(user + ":") for u in e.users)]
    internal = [e for e in mine if e.name not in INTERFACE]
    return {"entries": len(mine), "names": sum(len(e.names) for e in mine),
            "internal_entries": len(internal), "internal_names": sum(len(e.names) for e in internal)}
