"""Mutation rows for building models and data (see :mod:`tests.mutations`)."""

from __future__ import annotations

from tests.mutations.row import Mutation

ROWS = (
    Mutation(
        "a built model is not replaced without --force",
        "a rebuild replaces the model in --out",
        "asyncrl/prepare/main.py",
        '    if (out / "config.json").exists() and not args.force:',
        "    if False:",
        ("tests/test_prepare_cli.py",),
    ),
    Mutation(
        "over-long validation rows are left out with the filter on",
        "no validation row is measured (over-long ones are kept and cut)",
        "asyncrl/tasks/lengths.py",
        "    long = set(overlong_rows(rows, tokenizer_path, prompt_key, limit, episodes))\n",
        "    long: set[int] = set()\n",
        (
            "tests/test_task_source_val_filter.py::test_overlong_validation_rows_are_left_out_with_the_filter_on",
        ),
    ),
    Mutation(
        "extra_info values that would reach the scorer as text are refused",
        "dates and decimals in extra_info load (the scorer gets strings)",
        "asyncrl/tasks/parquet.py",
        "        if (found := _textual_value(extra)) is not None:\n",
        "        if (found := None) is not None:\n",
        (
            "tests/test_input_rows.py::test_extra_info_values_the_task_message_turns_to_text_are_refused",
        ),
    ),
    Mutation(
        "calculator data refuses more rows than it has distinct problems",
        "asking for more rows than there are products loops forever",
        "asyncrl/tasks/calculator.py",
        "    if n_train + n_val > max_rows():",
        "    if False:",
        (
            "tests/test_data_prepare.py::test_calculator_refuses_more_rows_than_it_has_distinct_problems",
        ),
    ),
    Mutation(
        "ground truths that would reach the scorer as text are refused",
        "a decimal or date ground truth reaches the scorer as a string",
        "asyncrl/tasks/parquet.py",
        '    if (found := _textual_value(reward_model["ground_truth"])) is not None:',
        "    if (found := None) is not None:",
        (
            "tests/test_input_rows.py::test_ground_truths_the_task_message_turns_to_text_are_refused",
        ),
    ),
    Mutation(
        "a model build into a folder of other files is refused",
        "the build replaces a folder of models or checkpoints given as --out",
        "asyncrl/prepare/main.py",
        '    if out.is_dir() and not (out / "config.json").exists() and any(out.iterdir()):',
        "    if False:",
        (
            "tests/test_prepare_cli.py::"
            "test_a_model_build_into_a_folder_of_other_files_is_refused_and_keeps_them",
        ),
    ),
    Mutation(
        "the calculator warm start holds out --n-val",
        "the calculator warm start ignores --n-val and trains on the data's validation rows",
        "asyncrl/prepare/main.py",
        "    train, val = calculator.generate(seed=args.data_seed, n_val=args.n_val)",
        "    train, val = calculator.generate(seed=args.data_seed)",
        (
            "tests/test_prepare_cli.py::"
            "test_the_calculator_warm_start_refuses_arithmetic_flags_and_holds_out_n_val",
        ),
    ),
    Mutation(
        "an arithmetic split does not depend on the operators' order",
        "problems are listed in the order --ops gives them",
        "asyncrl/tasks/arithmetic.py",
        "    unique_ops = tuple(op for op in SUPPORTED_OPS if op in ops)",
        "    unique_ops = tuple(dict.fromkeys(ops))",
        (
            "tests/test_prepare_cli.py::"
            "test_an_arithmetic_split_does_not_depend_on_the_order_the_operators_are_given",
        ),
    ),
    Mutation(
        "both data files appear together",
        "train.parquet is written in place before val.parquet",
        "asyncrl/tasks/__init__.py",
        '        built.append((write_rows(kept, out_dir / f".{name}.parquet.new", schema=schema), path))',
        "        built.append((write_rows(kept, path, schema=schema), path))",
        ("tests/test_prepare_cli.py::test_both_data_files_appear_together",),
    ),
)
