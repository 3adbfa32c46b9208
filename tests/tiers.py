"""Cases of a parametrized test that belong in the slow tier:
``@pytest.mark.parametrize("name", cases(NAMES, slow={"llama": "why"}))``; and the tests the
fast tier hands to the slow tier for its time (``MOVED``)."""

# ruff: noqa: E501  (test ids are as long as they are)

import pytest


def cases(values, slow):
    """``values`` for ``parametrize``, those named in ``slow`` marked with their reason."""
    unknown = set(slow) - set(values)
    assert not unknown, f"slow cases {sorted(unknown)} are not among {list(values)}"
    return [
        pytest.param(v, marks=pytest.mark.slow(reason=slow[v])) if v in slow else v for v in values
    ]


# The costliest tests of the fast tier, each 8 s or more in a run of the whole fast tier on the
# 2-core machine under load (seconds as measured there, about 2.5x an idle run's): they run in
# the slow tier, which ``.ci/run`` runs after the fast one, so the README's test command stays
# within its time. Every one has cheaper neighbours in the fast tier checking the same code.
MOVED = (
    # From an idle fresh-clone run (cold compilation cache) after the first move:
    "tests/test_pretrained_hf.py::test_decoder_logits_match_transformers[qwen2]",  # 7.4 s idle
    "tests/test_score_mod_closures.py::test_a_model_closing_over_integer_arrays_trains_scanned_and_unstacked",  # 5.2 s idle
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[key]",  # 4.8 s idle
    "tests/test_moe.py::test_dense_prefix_scanned_and_unrolled_forward_agree",  # 4.6 s idle
    "tests/test_hybrid_stack.py::test_the_training_program_does_not_grow_with_the_repeats",  # 4.2 s idle
    "tests/test_length_eval.py::test_loss_by_length_equals_a_direct_computation[chunks]",  # 3.9 s idle
    "tests/test_hybrid_stack.py::test_full_forward_equals_prefill_and_decode_on_ragged_batches",  # 3.8 s idle
    "tests/test_rope_scaling.py::test_frequencies_match_transformers[linear]",  # 3.7 s idle
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[rope-mqa-window-remat_dots]",  # 3.7 s idle
    "tests/test_ops_flex.py::test_a_direct_call_with_a_cache_spec_gives_the_score_function_positions[pallas_tpu]",  # 3.6 s idle
    "tests/test_surgery_run.py::test_the_trainer_freezes_by_selection_and_trains_the_rest",  # 3.6 s idle
    "tests/test_pretrained_hybrid.py::test_falcon_h1_logits_match_transformers_with_left_padding",  # 3.5 s idle
    "tests/test_hybrid_stack.py::test_generate_with_the_cache_equals_recomputation_on_ragged_prompts",  # 3.4 s idle
    "tests/test_distill.py::test_attention_mse_is_float64_numpy_on_a_tiny_teacher",  # 3.4 s idle
    "tests/test_mixer_differential_mla.py::test_gradients_are_finite_with_fully_masked_rows[mla]",  # 3.4 s idle
    # From the loaded run (about 2.5x an idle run's seconds):
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[08_a_variant_with_its_own_parameters]",  # 46 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[12_length_generalization]",  # 41 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[05_causal_mask_ablation]",  # 39 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[07_prototype_a_variant]",  # 38 s
    "tests/test_attention_zoo.py::test_the_sweep_covers_every_row_and_the_table_reads",  # 36 s
    "tests/test_export_hf.py::test_exported_model_loads_in_transformers_with_equal_logits[gemma2]",  # 33 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[06_attention_maps]",  # 31 s
    "tests/test_tracking.py::test_events_hold_the_metrics_wandb_offline_and_a_profile_trace",  # 29 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[encoder_decoder-relative-qknorm-remat_dots]",  # 26 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[04_train_char_model]",  # 26 s
    "tests/test_sweep.py::test_every_shipped_sweep_plans_on_its_tiny_config",  # 25 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[03_heads_gqa_kv_cache]",  # 24 s
    "tests/test_runs.py::test_sigterm_leaves_a_restorable_checkpoint",  # 23 s
    "tests/test_runs.py::test_full_eval_scores_every_validation_token_once",  # 22 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[encoder_decoder-relative-qknorm-remat_dots]",  # 19 s
    "tests/test_sweep_arms.py::test_each_arm_trains_at_each_seed_and_reopens",  # 18 s
    "tests/test_hybrid_stack.py::test_scanned_hybrid_equals_unrolled_for_loss_and_gradients_with_remat",  # 18 s
    "tests/test_surgery.py::test_three_of_every_four_layers_become_gated_deltanet_the_rest_bitwise_kept",  # 18 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[02_positions]",  # 17 s
    "tests/test_distill.py::test_the_teacher_takes_no_gradient_and_no_optimiser_state",  # 17 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[01_attention_from_scratch]",  # 17 s
    "tests/test_long_context_passkey.py::test_tiny_run_warm_starts_and_scores_by_distance",  # 16 s
    "tests/test_readme.py::test_readme_python_blocks_run",  # 16 s
    "tests/test_attention_zoo.py::test_the_recurrent_rows_and_hybrids_are_matched_within_one_ffn_column",  # 16 s
    "tests/test_runs.py::test_resume_is_exact[3]",  # 14 s
    "tests/test_pretrained_hybrid.py::test_bamba_logits_match_transformers_with_left_padding",  # 14 s
    "tests/test_sweep.py::test_vmapped_trials_match_each_trial_run_alone",  # 14 s
    "tests/test_layer_stack.py::test_unstacked_and_scanned_decoding_agree[rope-mqa-window-remat_dots]",  # 14 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[encoder-none-dropout-remat_full]",  # 14 s
    "tests/test_docs.py::test_site_builds_strict",  # 14 s
    "tests/test_surgery_run.py::test_a_surgery_run_starts_from_the_source_with_its_untouched_layers_bitwise",  # 14 s
    "tests/test_variants.py::test_import_attnlab_is_light",  # 13 s
    "tests/test_surgery.py::test_the_surgered_model_decodes_with_the_cache_as_its_full_forward_pass",  # 12 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[rope-mqa-window-remat_dots]",  # 12 s
    "tests/test_mixer_sinks_gated.py::test_cached_decode_matches_recompute[gated-encdec]",  # 12 s
    "tests/test_mixer_recurrent.py::test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill[mamba2]",  # 12 s
    "tests/test_text_generation.py::test_generate_text_equals_transformers_generate_and_decode",  # 11 s
    "tests/test_pretrained_float64.py::test_float64_decodes_through_a_float64_cache",  # 11 s
    "tests/test_pretrained_qwen3_next.py::test_qwen3_next_logits_match_transformers_with_left_padding",  # 11 s
    "tests/test_qwen3_next_parts.py::test_moe_with_gated_shared_expert_equals_qwen3_next_sparse_moe_block",  # 11 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[falcon_h1]",  # 11 s
    "tests/test_cli.py::test_train_eval_plot_sample_for_a_language_model",  # 10 s
    "tests/test_mixers.py::test_layer_pattern_sets_each_layers_window_and_rope_base",  # 10 s
    "tests/test_layer_stack.py::test_per_layer_window_equals_blocks_applied_one_by_one",  # 9 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[distance]",  # 9 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[mha]",  # 9 s
    "tests/test_runs.py::test_short_run_lowers_the_loss",  # 9 s
    "tests/test_checkpoint.py::test_sigterm_saves_and_exits_cleanly",  # 9 s
    "tests/test_hybrid_stack.py::test_cached_decoding_is_scanned_over_the_repeats",  # 9 s
    "tests/test_decode.py::test_grouped_options_equal_their_keyword_shorthands",  # 9 s
    "tests/test_layer_stack.py::test_traced_program_is_flat_in_depth",  # 9 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[gpt_oss]",  # 9 s
    "tests/test_pretrained_open.py::test_greedy_with_cache_matches_transformers[gemma3_text]",  # 9 s
    "tests/test_docs_examples.py::test_page_examples_run[concepts/kv_cache.md]",  # 9 s
    "tests/test_models.py::test_padding_invariance_and_no_nan[encoder_decoder]",  # 9 s
    "tests/test_runs.py::test_the_train_step_compiles_once_across_logs_and_evaluations",  # 9 s
    "tests/test_pretrained_moe.py::test_logits_match_transformers_with_left_padding[gpt_oss]",  # 8 s
)
MOVED_REASON = "among the fast tier's costliest tests (tests/tiers.py: MOVED), run with the slow tier"


# What ``.ci/run`` leaves to ``bash .ci/long``: each entry a test id, a test function (all its
# cases) or a file, beyond the 20 minutes CI has for the install, the site and the fast, slow,
# lowering and cluster tiers. Each has a representative that CI runs (named beside it).
LONG: tuple[str, ...] = ()
LONG_REASON = "beyond .ci/run's time (tests/tiers.py: LONG); bash .ci/long runs it"


def in_long(nodeid: str) -> bool:
    """Whether ``nodeid`` is, or lies in, an entry of ``LONG``."""
    base = nodeid.split("[", 1)[0]
    return any(nodeid == e or base == e or nodeid.startswith(e + "::") for e in LONG)
