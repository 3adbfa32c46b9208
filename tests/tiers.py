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
    # From a fresh-clone CI run that took 299 s (1,161 tests), its costliest (5 s or more each in
    # a loaded run of the whole tier):
    "tests/test_pretrained_hf.py::test_decoder_logits_match_transformers[qwen3]",
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[query]",
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[mha]",
    "tests/test_pretrained_hybrid.py::test_nemotron_h_logits_match_transformers_with_left_padding",
    "tests/test_length_eval.py::test_loss_by_length_equals_a_direct_computation[sliding]",
    "tests/test_layer_stack.py::test_unstacked_decoding_slices_no_weights_per_token",
    "tests/test_pretrained_qwen3_next.py::test_qwen3_next_exports_and_round_trips",
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[fox]",
    "tests/test_runs.py::test_a_run_prints_a_header_and_a_summary_and_reopens_as_a_run",
    "tests/test_ring_cache.py::test_ring_decoding_equals_the_linear_cache_and_the_full_forward[rope]",
    "tests/test_kv_cache.py::test_a_split_cache_steps_like_the_stacked_one",
    "tests/test_fuzz.py::test_train_runs_or_fails_with_one_named_error",
    "tests/test_sweep_search.py::test_a_masked_row_of_a_stacked_state_stops_changing",
    "tests/test_rope_scaling.py::test_frequencies_match_transformers[llama3]",
    "tests/test_text_generation.py::test_sample_cli_prints_the_continuation",
    "tests/test_benchmark_profile.py::test_breakdown_finds_the_matmul_and_the_rest_of_a_program",
    "tests/test_patch.py::test_replacing_every_intermediate_with_its_own_value_is_bitwise_the_identity",
    "tests/test_mixer_mamba.py::test_the_layer_is_the_papers_recurrence_in_float64[False]",
    "tests/test_length_eval.py::test_the_cli_writes_json_and_a_plot",
    "tests/test_reliability.py::test_eval_and_sample_refuse_non_finite_parameters",
    "tests/test_pretrained_hf.py::test_greedy_matches_transformers_generate[qwen2]",
    "tests/test_mixers.py::test_a_variant_defined_outside_the_library_runs_its_own_maths",
    "tests/test_ops_pallas_flex_tpu.py::test_matches_float64[packed]",
    "tests/test_length_eval.py::test_the_cli_refuses_a_length_past_a_learned_table",
    "tests/test_inspect.py::test_decoder_captures_match_float64_formulas_and_add_nothing",
    "tests/test_mixer_recurrent.py::test_chunked_step_and_scan_equal_the_float64_equations[gated_delta_rule]",
    "tests/test_runs.py::test_eval_matches_manual_loss",
    "tests/test_chunked_models.py::test_auto_runs_blockwise_on_cpu_from_its_threshold_with_the_reference_logits[decoder-alibi-gqa-window_on_layer_1-segments]",
    "tests/test_data_bpe.py::test_bpe_round_trips_and_is_deterministic",
    "tests/test_lora.py::test_the_update_is_a_dense_delta_of_rank_r_in_float64",
    "tests/test_mixer_lolcats.py::test_prefill_then_steps_equal_one_forward_pass[3]",
    "tests/test_mixer_recurrent.py::test_a_decoder_decodes_ragged_prompts_like_its_forward_pass[gated_deltanet]",
    "tests/test_surgery.py::test_a_mixer_only_mask_leaves_the_layers_norms_and_ffn_out",
    "tests/test_data_grain.py::test_packed_documents_do_not_attend_to_each_other",
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[rope-encoder_decoder]",
    "tests/test_pretrained_open.py::test_logits_match_transformers_with_left_padding[gemma2]",
    "tests/test_sampling.py::test_same_seed_same_tokens_other_seed_other_tokens",
    "tests/test_models.py::test_attention_weights_returned[encoder_decoder]",
    "tests/test_variants.py::test_attention_dropout_reaches_the_variant",
    "tests/test_runs.py::test_workdir_with_another_model_is_refused",
    "tests/test_lora_runs.py::test_only_the_adapters_train_and_hold_optimiser_state",
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
    # From an idle fresh-clone run whose fast tier took 255 s (seconds there, idle): the
    # sweep CLI's module fixture (10.2 s) goes with the two fast tests that used it.
    "tests/test_sweep.py::test_cli_prints_groups_and_trial_dirs_look_like_train_dirs",  # 10.2 s idle
    "tests/test_sweep.py::test_nan_trial_is_recorded_as_failed_and_the_others_finish",
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[olmo2]",  # 7.6 s idle
    "tests/test_rope_scaling.py::test_frequencies_match_transformers[yarn_gpt_oss]",  # 5.5 s idle
    "tests/test_hybrid_stack.py::test_a_parallel_layer_is_the_sum_of_its_mixers",  # 5.4 s idle
    "tests/test_ops_pallas_flex_tpu.py::test_matches_float64[gemma2]",  # 4.6 s idle
    "tests/test_mixer_sinks_gated.py::test_gradients_finite_with_fully_masked_rows[sinks-decoder]",  # 4.6 s idle
    "tests/test_lora_runs.py::test_adapters_start_on_another_run_named_by_surgery_run",  # 3.9 s idle
)
MOVED_REASON = (
    "among the fast tier's costliest tests (tests/tiers.py: MOVED), run with the slow tier"
)


# What ``.ci/run`` leaves to ``bash .ci/long``: each entry a test id, a test function (all its
# cases) or a file, beyond the 20 minutes CI has for the install, the site and the fast, slow,
# lowering and cluster tiers. Chosen from a whole slow-tier run (its seconds beside each, on
# the 2-core machine under a load of 6-9; an idle CI run took 0.48 s of wall time per second
# listed): .ci/run keeps every multi-device and multi-process child and then the cheapest
# cases up to 800 of the 6,200 seconds; the costlier cases of each family, mixer,
# experiment and notebook run in .ci/long.
LONG: tuple[str, ...] = (
    "tests/test_attention_transfer.py::test_tiny_pipeline_from_a_hugging_face_folder",  # 11 s
    "tests/test_attention_transfer.py::test_tiny_pipeline_from_a_run_trained_here_resumes",  # 26 s
    "tests/test_attention_transfer.py::test_the_harness_scores_a_student_on_the_tasks_at_its_length",  # 40 s
    "tests/test_attention_zoo.py::test_the_recurrent_rows_and_hybrids_are_matched_within_one_ffn_column",  # 8 s
    "tests/test_attention_zoo.py::test_the_tiny_sweep_runs_and_reports",  # 41 s
    "tests/test_bad_inputs.py::test_eight_devices_evaluate_a_batch_they_cannot_split_and_sigterm_exits_143",  # 11 s
    "tests/test_bad_inputs_silent.py::test_extend_on_the_command_line_carries_the_rate_on",  # 4 s
    "tests/test_bad_inputs_startup.py::test_sample_says_how_many_sampled_ids_had_no_text",  # 4 s
    "tests/test_chunked_memory.py::test_memory_is_linear_in_the_sequence_length",  # 20 s
    "tests/test_chunked_models.py::test_auto_runs_blockwise_on_cpu_from_its_threshold_with_the_reference_logits[encoder_decoder-relative-mqa-padding-window_on_layer_1]",  # 5 s
    "tests/test_chunked_models.py::test_chunked_model_equals_reference_logits_and_gradients[decoder-alibi-gqa-window_on_layer_1-segments]",  # 5 s
    "tests/test_chunked_models.py::test_chunked_model_equals_reference_logits_and_gradients[encoder_decoder-relative-mqa-padding-window_on_layer_1]",  # 11 s
    "tests/test_cli.py::test_a_variant_registered_by_its_experiment_file_reopens_in_fresh_processes",  # 19 s
    "tests/test_cli.py::test_sample_for_an_encoder_decoder_needs_a_source",  # 8 s
    "tests/test_data_bpe.py::test_a_tiny_run_trains_with_bpe_and_resumes_with_the_same_tokenizer",  # 6 s
    "tests/test_data_grain.py::test_a_run_on_packed_grain_batches_resumes_bitwise",  # 7 s
    "tests/test_data_pipeline.py::test_a_packed_run_killed_with_sigkill_resumes_bitwise",  # 14 s
    "tests/test_data_pipeline.py::test_a_run_of_several_processes_saves_and_restores_the_pipeline_state",  # 7 s
    "tests/test_data_prepared.py::test_a_corpus_larger_than_the_process_may_read_is_memory_mapped",  # 6 s
    "tests/test_decode.py::test_a_short_generation_gets_a_cache_of_the_phase_it_needs",  # 26 s
    "tests/test_decode.py::test_an_unstacked_model_generates_what_the_stacked_one_does",  # 46 s
    "tests/test_decode.py::test_beam_search_one_beam_is_greedy_and_more_beams_score_higher",  # 14 s
    "tests/test_decode.py::test_bfloat16_decoding_follows_the_float32_model",  # 32 s
    "tests/test_decode.py::test_grouped_options_equal_their_keyword_shorthands",  # 20 s
    "tests/test_decode.py::test_long_generation_through_cache_phases_matches_full_forward",  # 29 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[alibi-encoder_decoder]",  # 19 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[learned-decoder]",  # 21 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[learned-encoder_decoder]",  # 18 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[relative-decoder]",  # 8 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[relative-encoder_decoder]",  # 18 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[rope-decoder]",  # 15 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[sinusoidal-decoder]",  # 6 s
    "tests/test_decode.py::test_prefill_plus_steps_equals_full_forward[sinusoidal-encoder_decoder]",  # 26 s
    "tests/test_decode.py::test_seq2seq_greedy_equals_full_recomputation",  # 14 s
    "tests/test_decode.py::test_weights_stored_output_axes_first_generate_what_the_model_does",  # 10 s
    "tests/test_devices.py::test_steps_dispatched_without_reading_results_do_not_hang_on_two_cpu_devices",  # 47 s
    "tests/test_distill.py::test_attention_mse_is_float64_numpy_on_a_tiny_teacher",  # 7 s
    "tests/test_distill.py::test_the_teacher_takes_no_gradient_and_no_optimiser_state",  # 14 s
    "tests/test_docs.py::test_site_builds_strict",  # 7 s
    "tests/test_docs_examples.py::test_page_examples_run[concepts/kv_cache.md]",  # 5 s
    "tests/test_elastic_resume.py::test_a_run_saved_on_one_device_opens_and_resumes_on_eight",  # 14 s
    "tests/test_evaluation_harness.py::test_a_pretrained_folder_scores_as_transformers_does",  # 13 s
    "tests/test_evaluation_harness.py::test_eval_harness_command_prints_the_results",  # 13 s
    "tests/test_evaluation_harness.py::test_harness_loglikelihoods_equal_a_direct_computation",  # 38 s
    "tests/test_export_hf.py::test_a_qwen3_next_shaped_run_exports_with_equal_logits",  # 21 s
    "tests/test_export_hf.py::test_a_surgery_run_into_qwen3_next_shape_exports_with_equal_logits",  # 29 s
    "tests/test_export_hf.py::test_export_hf_command_round_trips_a_trained_run[gemma2]",  # 7 s
    "tests/test_export_hf.py::test_export_hf_command_round_trips_a_trained_run[llama]",  # 4 s
    "tests/test_export_hf.py::test_exported_model_loads_in_transformers_with_equal_logits[gemma3]",  # 5 s
    "tests/test_export_hf.py::test_exported_model_loads_in_transformers_with_equal_logits[llama]",  # 9 s
    "tests/test_fuzz.py::test_train_runs_or_fails_with_one_named_error_all",  # 10 s
    "tests/test_global_batch.py::test_two_processes_of_four_devices_train_on_one_devices_batches",  # 17 s
    "tests/test_hybrid_stack.py::test_a_ring_cache_serves_a_hybrid_whose_attention_slides",  # 7 s
    "tests/test_hybrid_stack.py::test_beam_scores_are_the_full_forward_log_probabilities",  # 6 s
    "tests/test_hybrid_stack.py::test_generate_handles_left_padded_ragged_prompts",  # 54 s
    "tests/test_hybrid_stack.py::test_generate_with_the_cache_equals_recomputation_on_ragged_prompts",  # 7 s
    "tests/test_hybrid_stack.py::test_hybrid_on_eight_cpu_devices",  # 94 s
    "tests/test_hybrid_stack.py::test_scanned_hybrid_decoding_equals_unrolled[unrolled]",  # 15 s
    "tests/test_hybrid_stack.py::test_scanned_hybrid_decoding_equals_unrolled[unstacked]",  # 53 s
    "tests/test_hybrid_stack.py::test_scanned_hybrid_equals_unrolled_for_loss_and_gradients_with_remat",  # 17 s
    "tests/test_hybrid_stack.py::test_the_training_program_does_not_grow_with_the_repeats",  # 89 s
    "tests/test_import_variant.py::test_train_with_import_then_sample_in_another_process",  # 11 s
    "tests/test_inspect.py::test_hybrid_captures_attention_by_hand_and_the_recurrent_state_of_the_cache",  # 8 s
    "tests/test_layer_stack.py::test_per_layer_window_equals_blocks_applied_one_by_one",  # 26 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[alibi-gqa-window_on_layer_1]",  # 36 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[encoder_decoder-relative-qknorm-remat_dots]",  # 46 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[encoder_decoder-sinusoidal-gqa]",  # 24 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[learned-mha]",  # 14 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[rope-mqa-window-remat_dots]",  # 33 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_cached_decoding_and_the_full_forward[sinusoidal-gqa-post-remat_full]",  # 21 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[alibi-gqa-window_on_layer_1]",  # 6 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[encoder-none-dropout-remat_full]",  # 15 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[encoder_decoder-relative-qknorm-remat_dots]",  # 21 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[encoder_decoder-sinusoidal-gqa]",  # 20 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[learned-mha]",  # 18 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[rope-mqa-window-remat_dots]",  # 15 s
    "tests/test_layer_stack.py::test_scanned_equals_unrolled_logits_and_gradients[sinusoidal-gqa-post-remat_full]",  # 17 s
    "tests/test_layer_stack.py::test_traced_program_is_flat_in_depth",  # 29 s
    "tests/test_layer_stack.py::test_unstacked_and_scanned_decoding_agree[encoder_decoder-sinusoidal-gqa]",  # 63 s
    "tests/test_layer_stack.py::test_unstacked_and_scanned_decoding_agree[rope-mqa-window-remat_dots]",  # 44 s
    "tests/test_length_tasks.py::test_the_task_folder_runs_in_the_harness",  # 18 s
    "tests/test_long_context_passkey.py::test_tiny_run_warm_starts_and_scores_by_distance",  # 6 s
    "tests/test_lora.py::test_only_adapters_train_and_a_stopped_stage_resumes_bitwise",  # 10 s
    "tests/test_mixer_differential_mla.py::test_cached_decoding_equals_the_forward_pass[differential-encoder_decoder]",  # 4 s
    "tests/test_mixer_differential_mla.py::test_cached_decoding_equals_the_forward_pass[mla-encoder_decoder]",  # 4 s
    "tests/test_mixer_dsa.py::test_a_prefill_split_anywhere_then_a_step_equals_one_pass",  # 4 s
    "tests/test_mixer_dsa.py::test_a_train_step_reports_and_optimises_the_indexer_loss",  # 5 s
    "tests/test_mixer_dsa.py::test_gradients_are_finite_with_fully_masked_rows",  # 5 s
    "tests/test_mixer_dsa.py::test_the_indexer_loss_trains_the_indexer_alone",  # 4 s
    "tests/test_mixer_kda.py::test_a_decoder_decodes_ragged_prompts_like_its_forward_pass",  # 5 s
    "tests/test_mixer_kda.py::test_gradients_are_finite_with_masked_rows",  # 6 s
    "tests/test_mixer_lightning.py::test_gradients_are_finite_with_masked_rows",  # 4 s
    "tests/test_mixer_mamba.py::test_gradients_are_finite_with_masked_rows",  # 4 s
    "tests/test_mixer_moba.py::test_moba_decodes_ragged_prompts_like_its_forward_pass",  # 4 s
    "tests/test_mixer_nsa.py::test_nsa_decodes_ragged_prompts_like_its_forward_pass",  # 8 s
    "tests/test_mixer_nsa.py::test_nsa_gradients_are_finite_with_masked_rows",  # 5 s
    "tests/test_mixer_recurrent.py::test_a_bfloat16_state_decodes_close_to_the_float32_one[gated_deltanet]",  # 37 s
    "tests/test_mixer_recurrent.py::test_a_bfloat16_state_decodes_close_to_the_float32_one[mamba2]",  # 21 s
    "tests/test_mixer_recurrent.py::test_a_decoder_decodes_ragged_prompts_like_its_forward_pass[mamba2]",  # 5 s
    "tests/test_mixer_recurrent.py::test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill[gated_deltanet]",  # 14 s
    "tests/test_mixer_recurrent.py::test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill[mamba2]",  # 11 s
    "tests/test_mixer_recurrent.py::test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill_all[gated_deltanet]",  # 10 s
    "tests/test_mixer_recurrent.py::test_a_decoder_prefilled_in_pieces_decodes_as_one_prefill_all[mamba2]",  # 9 s
    "tests/test_mixer_recurrent.py::test_a_prefill_split_anywhere_then_decoded_equals_one_prefill[gated_deltanet]",  # 9 s
    "tests/test_mixer_recurrent.py::test_generation_and_beams_through_the_cache_equal_recomputation[gated_deltanet]",  # 33 s
    "tests/test_mixer_recurrent.py::test_generation_and_beams_through_the_cache_equal_recomputation[mamba2]",  # 18 s
    "tests/test_mixer_recurrent.py::test_left_padding_changes_nothing_at_real_tokens[gated_deltanet]",  # 4 s
    "tests/test_mixer_recurrent.py::test_training_a_few_steps_lowers_the_loss[gated_deltanet]",  # 14 s
    "tests/test_mixer_recurrent.py::test_training_a_few_steps_lowers_the_loss[mamba2]",  # 11 s
    "tests/test_mixer_sinks_gated.py::test_cached_decode_matches_recompute[gated-encdec]",  # 5 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[differential]",  # 7 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[gated]",  # 6 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[mha]",  # 7 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[mla]",  # 6 s
    "tests/test_mixers.py::test_each_built_in_variant_in_an_encoder_ignores_padding_and_remat_keeps_gradients[sinks]",  # 7 s
    "tests/test_mixers.py::test_it_trains_resumes_exactly_and_loads_back",  # 13 s
    "tests/test_mixers.py::test_its_cache_holds_its_state_and_decoding_equals_the_forward_pass",  # 10 s
    "tests/test_moe.py::test_dense_prefix_scanned_and_unrolled_forward_agree",  # 4 s
    "tests/test_moe.py::test_the_auxiliary_losses_join_the_objective_with_their_weights",  # 10 s
    "tests/test_mtp.py::test_drafts_of_a_trained_model_are_accepted_and_the_output_stays_greedy",  # 8 s
    "tests/test_mtp.py::test_speculative_decoding_returns_the_greedy_tokens",  # 6 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[01_attention_from_scratch]",  # 21 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[02_positions]",  # 31 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[03_heads_gqa_kv_cache]",  # 31 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[04_train_char_model]",  # 29 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[05_causal_mask_ablation]",  # 37 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[06_attention_maps]",  # 26 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[07_prototype_a_variant]",  # 40 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[08_a_variant_with_its_own_parameters]",  # 42 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[09_model_surgery]",  # 78 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[10_look_inside]",  # 19 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[11_attention_transfer]",  # 31 s
    "tests/test_notebooks.py::test_notebook_runs_on_tiny_settings[12_length_generalization]",  # 29 s
    "tests/test_notebooks.py::test_the_attention_maps_notebook_runs_without_the_shared_folder",  # 14 s
    "tests/test_ops_pallas_flex.py::test_gpu_kernel_bfloat16_no_mask",  # 4 s
    "tests/test_ops_pallas_flex.py::test_gpu_kernel_matches_float64[causal_alibi]",  # 54 s
    "tests/test_ops_pallas_flex.py::test_gpu_kernel_matches_float64[offset_valid_cross]",  # 4 s
    "tests/test_ops_pallas_flex.py::test_splash_matches_float64",  # 5 s
    "tests/test_ops_pallas_flex.py::test_tpu_kernel_matches_float64",  # 8 s
    "tests/test_ops_pallas_flex_tpu.py::test_default_blocks_and_one_query",  # 9 s
    "tests/test_optimizers.py::test_muon_leaves_recurrent_conv_kernels_and_vectors_to_adam",  # 9 s
    "tests/test_parametrization.py::test_at_the_base_width_and_depth_mup_and_completep_are_standard_bitwise",  # 11 s
    "tests/test_parametrization.py::test_every_registered_mixer_and_architecture_has_roles_and_a_standard_base",  # 7 s
    "tests/test_parametrization.py::test_every_registered_optimizer_keeps_its_rates_in_the_state_and_steps",  # 6 s
    "tests/test_parametrization.py::test_initial_parameters_and_updates_follow_the_table",  # 6 s
    "tests/test_parametrization.py::test_the_coordinate_check_is_flat_under_mup_and_grows_under_standard",  # 15 s
    "tests/test_parametrization.py::test_the_standard_form_computes_the_same_and_exports_as_llama",  # 5 s
    "tests/test_patch.py::test_sweep_at_layer_zero_is_the_corrupted_run_with_one_clean_token",  # 4 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[apertus]",  # 5 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[deepseek_v32]",  # 6 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[glm4_moe]",  # 8 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[granitemoehybrid]",  # 7 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[jamba]",  # 10 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[minimax]",  # 9 s
    "tests/test_pretrained_catalogue.py::test_export_round_trips[olmo3]",  # 5 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[apertus]",  # 8 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[deepseek_v32]",  # 28 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[glm4_moe]",  # 15 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[granitemoehybrid]",  # 20 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[jamba]",  # 28 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[kimi_linear]",  # 78 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[lfm2]",  # 12 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[mamba]",  # 28 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[minimax]",  # 40 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[olmo3]",  # 11 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[qwen3_5_text]",  # 18 s
    "tests/test_pretrained_catalogue.py::test_greedy_with_cache_matches_transformers[smollm3]",  # 12 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[apertus]",  # 6 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[deepseek_v32]",  # 15 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[glm4_moe]",  # 20 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[granitemoehybrid]",  # 29 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[jamba]",  # 19 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[kimi_linear]",  # 40 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[lfm2]",  # 8 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[mamba]",  # 7 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[minimax]",  # 49 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[olmo3]",  # 5 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[qwen3_5_moe_text]",  # 24 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[qwen3_5_text]",  # 17 s
    "tests/test_pretrained_catalogue.py::test_logits_match_transformers_and_the_feature_matters[smollm3]",  # 42 s
    "tests/test_pretrained_catalogue_sizes.py::test_published_sizes_from_the_config_alone[kimi_linear]",  # 24 s
    "tests/test_pretrained_float64.py::test_float64_decodes_through_a_float64_cache",  # 30 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[apertus]",  # 9 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[bamba]",  # 14 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[bart]",  # 9 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[deepseek_v32]",  # 16 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[deepseek_v3]",  # 25 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[falcon_h1]",  # 10 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[gemma]",  # 7 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[glm4_moe]",  # 18 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[gpt_oss]",  # 18 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[granitemoehybrid]",  # 29 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[jamba]",  # 22 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[kimi_linear]",  # 44 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[lfm2]",  # 10 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[mamba2]",  # 6 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[mamba]",  # 15 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[minimax]",  # 39 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[mixtral]",  # 13 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[nemotron_h]",  # 18 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[olmo3]",  # 6 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen2]",  # 7 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen3]",  # 8 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen3_5_moe_text]",  # 33 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen3_5_text]",  # 20 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen3_moe]",  # 10 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[qwen3_next]",  # 23 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[smollm3]",  # 43 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[t5]",  # 11 s
    "tests/test_pretrained_float64.py::test_float64_equals_transformers_and_float32_is_as_close_as_theirs[t5_v1_1]",  # 12 s
    "tests/test_pretrained_hybrid.py::test_bamba_exports_and_round_trips",  # 5 s
    "tests/test_pretrained_hybrid.py::test_bamba_greedy_with_cache_matches_transformers",  # 59 s
    "tests/test_pretrained_hybrid.py::test_bamba_with_an_irregular_layout_loads_it_as_a_prefix_and_its_features_matter",  # 38 s
    "tests/test_pretrained_hybrid.py::test_falcon_h1_gated_norms_match_and_the_multipliers_matter[falcon_h1_norm_then_gate]",  # 19 s
    "tests/test_pretrained_hybrid.py::test_falcon_h1_greedy_with_cache_matches_transformers",  # 22 s
    "tests/test_pretrained_hybrid.py::test_falcon_h1_logits_match_transformers_with_left_padding",  # 14 s
    "tests/test_pretrained_hybrid.py::test_nemotron_h_greedy_with_cache_matches_and_its_squared_relu_matters",  # 6 s
    "tests/test_pretrained_moe.py::test_greedy_with_cache_matches_transformers[deepseek_v3]",  # 7 s
    "tests/test_pretrained_moe.py::test_greedy_with_cache_matches_transformers[gpt_oss]",  # 6 s
    "tests/test_pretrained_moe.py::test_greedy_with_cache_matches_transformers[mixtral]",  # 17 s
    "tests/test_pretrained_moe.py::test_greedy_with_cache_matches_transformers[qwen3_moe]",  # 11 s
    "tests/test_pretrained_moe.py::test_logits_match_transformers_with_left_padding[gpt_oss]",  # 5 s
    "tests/test_pretrained_moe.py::test_moe_shaped_model_exports_with_equal_logits[deepseek_v3]",  # 46 s
    "tests/test_pretrained_moe.py::test_moe_shaped_model_exports_with_equal_logits[mixtral]",  # 13 s
    "tests/test_pretrained_moe.py::test_moe_shaped_model_exports_with_equal_logits[qwen3_moe]",  # 18 s
    "tests/test_pretrained_open.py::test_greedy_with_cache_matches_transformers[olmo2]",  # 6 s
    "tests/test_pretrained_qwen3_moe_interleaved.py::test_interleaved_checkpoint_loads_decodes_and_exports_as_transformers[alternating]",  # 8 s
    "tests/test_pretrained_qwen3_moe_interleaved.py::test_interleaved_checkpoint_loads_decodes_and_exports_as_transformers[listed]",  # 6 s
    "tests/test_pretrained_qwen3_next.py::test_qwen3_next_logits_match_transformers_with_left_padding",  # 5 s
    "tests/test_pretrained_rope_scaling.py::test_greedy_with_cache_matches_transformers[gemma3_linear]",  # 11 s
    "tests/test_pretrained_rope_scaling.py::test_greedy_with_cache_matches_transformers[linear]",  # 6 s
    "tests/test_pretrained_rope_scaling.py::test_greedy_with_cache_matches_transformers[llama3]",  # 7 s
    "tests/test_pretrained_rope_scaling.py::test_greedy_with_cache_matches_transformers[longrope]",  # 5 s
    "tests/test_pretrained_rope_scaling.py::test_greedy_with_cache_matches_transformers[yarn]",  # 14 s
    "tests/test_pretrained_rope_scaling.py::test_logits_match_transformers_with_left_padding[yarn]",  # 6 s
    "tests/test_pretrained_rope_scaling.py::test_scaled_model_exports_with_equal_logits[gemma3_text]",  # 8 s
    "tests/test_pretrained_rope_scaling.py::test_scaled_model_exports_with_equal_logits[llama]",  # 7 s
    "tests/test_pretrained_ssm.py::test_mamba2_greedy_with_cache_matches_transformers",  # 13 s
    "tests/test_qwen3_next_parts.py::test_moe_with_gated_shared_expert_equals_qwen3_next_sparse_moe_block",  # 10 s
    "tests/test_readme.py::test_readme_python_blocks_run",  # 7 s
    "tests/test_recompute.py::test_greedy_recompute_equals_the_prefix_loop[True]",  # 9 s
    "tests/test_recompute.py::test_recompute_ragged_rows_equal_each_row_alone",  # 9 s
    "tests/test_recompute.py::test_seq2seq_recompute_equals_the_cached_decoder",  # 4 s
    "tests/test_runs.py::test_full_eval_refuses_a_task_without_a_validation_split",  # 9 s
    "tests/test_runs.py::test_full_eval_scores_every_validation_token_once",  # 15 s
    "tests/test_runs.py::test_resume_is_exact[3]",  # 12 s
    "tests/test_runs.py::test_resume_is_exact[5]",  # 11 s
    "tests/test_runs.py::test_saved_config_reloads_to_the_same_config",  # 5 s
    "tests/test_runs.py::test_short_run_lowers_the_loss",  # 5 s
    "tests/test_runs.py::test_sigterm_leaves_a_restorable_checkpoint",  # 13 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[base_conv]",  # 6 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[differential]",  # 49 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[dsa]",  # 23 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[gated]",  # 17 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[gated_deltanet]",  # 22 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[kda]",  # 28 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[lightning]",  # 16 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[lolcats]",  # 10 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[mamba2]",  # 18 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[mamba]",  # 13 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[mla]",  # 21 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[moba]",  # 5 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[nsa]",  # 8 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[short_conv]",  # 5 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_mixer[sinks]",  # 8 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[alibi]",  # 21 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[distance]",  # 62 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[forget_gate]",  # 23 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[head_bias]",  # 23 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[key]",  # 30 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[mixed]",  # 22 s
    "tests/test_score_mod_positions.py::test_cached_decoding_equals_recompute_for_every_score_function[softcap]",  # 22 s
    "tests/test_score_mod_positions.py::test_speculative_verification_sees_positions",  # 35 s
    "tests/test_sharding.py::test_two_processes_of_four_devices_train_like_one",  # 16 s
    "tests/test_sharding.py::test_mesh_tests_pass_on_eight_cpu_devices[other_variants]",  # 7 of the 12 variants on a mesh
    "tests/test_step_metrics.py::test_metrics_on_eight_cpu_devices",  # 10 s
    "tests/test_surgery.py::test_a_dense_prefix_of_a_mixture_of_experts_moves_into_the_pattern",  # 7 s
    "tests/test_surgery.py::test_a_hybrid_with_a_prefix_and_parallel_mixers_keeps_its_other_layers",  # 7 s
    "tests/test_surgery.py::test_the_surgered_model_decodes_with_the_cache_as_its_full_forward_pass",  # 5 s
    "tests/test_surgery.py::test_three_of_every_four_layers_become_gated_deltanet_the_rest_bitwise_kept",  # 4 s
    "tests/test_surgery.py::test_training_lowers_the_loss_and_leaves_frozen_parameters_unchanged",  # 10 s
    "tests/test_surgery_run.py::test_a_surgery_run_resumes_exactly_after_sigterm_and_reloads_as_an_ordinary_run",  # 40 s
    "tests/test_surgery_run.py::test_a_surgery_run_starts_from_a_hugging_face_checkpoint",  # 5 s
    "tests/test_surgery_run.py::test_a_surgery_run_starts_from_the_source_with_its_untouched_layers_bitwise",  # 6 s
    "tests/test_surgery_run.py::test_a_sweep_varies_the_surgery",  # 21 s
    "tests/test_surgery_run.py::test_the_trainer_freezes_by_selection_and_trains_the_rest",  # 5 s
    "tests/test_sweep.py::test_every_shipped_sweep_plans_on_its_tiny_config",  # 14 s
    "tests/test_sweep.py::test_interrupted_sweep_resumes_to_the_same_results",  # 12 s
    "tests/test_sweep.py::test_vmapped_trials_match_each_trial_run_alone",  # 18 s
    "tests/test_sweep_arms.py::test_each_arm_trains_at_each_seed_and_reopens",  # 9 s
    "tests/test_sweep_extend.py::test_more_steps_continue_finished_trials_exactly_and_new_seeds_run_alone",  # 21 s
    "tests/test_sweep_search.py::test_a_killed_search_resumes_its_study_without_losing_or_repeating_a_trial",  # 30 s
    "tests/test_sweep_search.py::test_a_pruned_trial_stops_inside_its_stacked_group",  # 15 s
    "tests/test_sweep_search.py::test_a_seeded_tpe_study_suggests_the_same_trials_twice",  # 28 s
    "tests/test_tracking.py::test_events_hold_the_metrics_wandb_offline_and_a_profile_trace",  # 9 s
    "tests/test_tracking.py::test_the_tensorboard_writer_does_not_import_torch",  # 6 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[attention_transfer]",  # 13 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[attention_variants]",  # 12 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[attention_zoo]",  # 10 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[causal_mask_ablation]",  # 11 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[differential_retrieval]",  # 11 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[gated_attention]",  # 20 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[length_nope]",  # 13 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[length_positions]",  # 10 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[length_ruler]",  # 37 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[long_context_passkey]",  # 40 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[mlm_encoder]",  # 13 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[moe_lm]",  # 14 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[mup_transfer]",  # 21 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[reverse_seq2seq]",  # 13 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[scaling_ladder]",  # 6 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[shakespeare_char]",  # 12 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[shakespeare_speedrun]",  # 16 s
    "tests/test_train.py::test_every_experiment_builds_and_takes_a_step[streaming_llm]",  # 6 s
    "tests/test_train.py::test_muon_orthogonalises_each_layer_matrix_as_plain_optax_muon_does",  # 29 s
    "tests/test_train.py::test_stacked_steps_mapped_or_vmapped_equal_each_trial_alone",  # 39 s
)
LONG_REASON = "beyond .ci/run's time (tests/tiers.py: LONG); bash .ci/long runs it"


def in_long(nodeid: str) -> bool:
    """Whether ``nodeid`` is, or lies in, an entry of ``LONG``."""
    base = nodeid.split("[", 1)[0]
    return any(nodeid == e or base == e or nodeid.startswith(e + "::") for e in LONG)
