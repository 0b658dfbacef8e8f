"""Break each promise of issue 15 once and watch its test fail: the "Done when" of the issue, made
repeatable.

    python benchmarks/break_promises.py                  # every break, one after another (~15-25
    min, 1 core)
    python benchmarks/break_promises.py --only fallback  # the breaks whose name contains a word
    python benchmarks/break_promises.py --list

Each break is a small edit of the product code (attnlab itself, never the tests) that undoes one
promise:
the folder renamed before its files are written, the manifest not checked, the 503 never given, ...
For each, the repository (src, tests, benchmarks, pyproject.toml) is copied to a temporary folder,
the edit is
applied there (it must match exactly once), and the promise's tests run against the copy; the break
is "seen" when pytest reports failures (exit 1), and "NOT SEEN" when the tests pass anyway (a test
that cannot fail) or pytest stops otherwise (an edit that no longer applies, a collection error).
The working tree is never touched, so this can run while one works. Prints a Markdown table
(benchmarks/README.md holds the last one); exit 1 if any break went unseen. This is mutation testing
by hand-picked mutants (mutmut and cosmic-ray pick them automatically; here each one is the negation
of a sentence of the issue).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("src", "tests", "benchmarks", "tools", "pyproject.toml", "README.md")


@dataclass
class Break:
    name: str  # a short id, for --only
    promise: str  # the sentence, shortened
    how: str  # the break, in words
    file: str  # relative to the repository root
    # (text that must occur exactly once, what it becomes), or (file, text, becomes)
    edits: list[tuple[str, ...]]
    tests: list[str]  # pytest node ids (and -k expressions after a space)


CK = "src/attnlab/training/checkpoint.py"
TR = "src/attnlab/training/trainer.py"
NATIVE = "src/attnlab/formats/native.py"
FILES = "src/attnlab/files.py"
RUNS = "src/attnlab/formats/runs.py"
UNTRUSTED_CHECKS = "src/attnlab/formats/untrusted.py"
CLI = "src/attnlab/cli.py"
GUARD = "src/attnlab/explorer/security.py"
QUEUE = "src/attnlab/explorer/work_queue.py"
CKT = "tests/test_training_checkpoints.py"
UNTRUSTED = "tests/test_formats_untrusted.py"
SEC = "tests/test_explorer_security.py"
QT = "tests/test_explorer_queue.py"
GEMMA3 = "tests/test_formats_gemma3.py"
INFERENCE = "tests/test_inference_layers.py"

BREAKS = [
    # Training: nothing is lost
    # ---------------------------------------------------------------------------
    Break(
        "commit",
        "the files of one checkpoint commit together (complete or absent)",
        "the folder gets its final name first, its files are written into it after",
        CK,
        [
            (
                "        files = ManifestFolder(tmp)\n",
                "        os.rename(tmp, final)\n        tmp = final\n        files = "
                "ManifestFolder(tmp)\n",
            ),
            (
                "        if final.exists():  # a damaged one a resume skipped, now rewritten\n    "
                "        _hide(final)\n"
                "        os.rename(tmp, final)\n",
                "",
            ),
        ],
        [
            f"{CKT}::test_a_kill_at_every_point_of_a_save_leaves_the_previous_or_the_new_checkpoint_complete"
        ],
    ),
    Break(
        "durable",
        "manifest last, the parent folder fsynced after the rename",
        "no fsync of checkpoints/ after the rename",
        CK,
        [("    fsync_dir(root)\n    prune(out, step)\n", "    prune(out, step)\n")],
        [
            f"{CKT}::test_a_save_makes_each_file_durable_then_the_manifest_then_one_rename_then_syncs_the_folder"
        ],
    ),
    Break(
        "leftovers",
        "leftovers of an interrupted save are cleaned at the next save",
        "the next save does not clean",
        CK,
        [("    remove_leftovers(out)\n    tmp = Path(", "    tmp = Path(")],
        [f"{CKT}::test_leftovers_of_an_interrupted_save_are_ignored_then_cleaned"],
    ),
    Break(
        "verify",
        "loading verifies the manifest: a truncated or bit-flipped file is refused, named",
        "loading a checkpoint folder skips its manifest",
        NATIVE,
        [
            (
                "    verify_manifest(path)\n    config = model_config_from",
                "    config = model_config_from",
            )
        ],
        [f"{CKT}::test_loading_a_damaged_checkpoint_folder_names_the_file"],
    ),
    Break(
        "digest",
        "a bit-flipped file (same size) is refused",
        "the manifest check compares sizes only",
        FILES,
        [('        if file_digest(target)["sha256"] != sha256:', "        if False:")],
        [f"{CKT}::test_loading_a_damaged_checkpoint_folder_names_the_file"],
    ),
    Break(
        "fallback",
        "--resume falls back to the previous complete checkpoint, saying so",
        # the walk --resume and loading a run share
        "a damaged newest checkpoint stops the resume",
        RUNS,
        [
            (
                "        except UserError as exc:\n            problems.append(str(exc))\n    "
                "return None, problems",
                "        except UserError:\n            raise\n    return None, problems",
            )
        ],
        [f"{CKT}::test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_saying_so"],
    ),
    Break(
        "none-complete",
        "no complete checkpoint: one line, never a silent fresh start",
        "--resume auto starts fresh on top of a damaged run",
        CK,
        [
            (
                "        if problems:\n            raise UserError(",
                "        if problems and required:\n            raise UserError(",
            )
        ],
        [f"{CKT}::test_no_complete_checkpoint_stops_with_one_line_naming_the_file"],
    ),
    Break(
        "auto",
        "--resume auto: resume when OUT holds a checkpoint, fresh when none",
        "--resume auto always starts fresh",
        "src/attnlab/training/cli.py",
        [
            (
                "    if args.resume:\n        checkpoint = find_checkpoint(",
                "    if args.resume is True:\n        checkpoint = find_checkpoint(",
            ),
            (
                TR,
                "        if resume and checkpoint is None:",
                "        if resume is True and checkpoint is None:",
            ),
        ],
        [f"{CKT}::test_resume_auto_starts_fresh_then_resumes_then_has_nothing_left_to_do"],
    ),
    Break(
        "auto-complete",
        "--resume auto on a finished run (--max-iters or --max-time reached): one line, exit 0",
        "a finished run under --resume auto is an error again",
        TR,
        [('            if finished is not None and resume == "auto":', "            if False:")],
        [f"{CKT} -k resume_auto"],
    ),
    Break(
        "microbatch",
        "torchrun without --gradient-accumulation-steps: one micro-batch per process",
        "the default is one micro-batch in all",
        TR,
        [
            (
                "cfg.gradient_accumulation_steps or self.dist.world",
                "cfg.gradient_accumulation_steps or 1",
            )
        ],
        ["tests/test_training_ddp.py::test_two_processes_match_one"],
    ),
    Break(
        "accumulation",
        "an explicit accumulation that does not divide by the world size: one line",
        "the refusal raised as a bare ValueError (a traceback)",
        TR,
        [
            (
                '            raise UserError(\n                f"--gradient-accumulation-steps (',
                '            raise ValueError(\n                f"--gradient-accumulation-steps (',
            )
        ],
        [
            "tests/test_training_ddp.py::test_an_accumulation_that_does_not_divide_over_the_processes_is_one_line"
        ],
    ),
    Break(
        "crash",
        "crash test: killed and resumed, the final losses equal the uninterrupted run's",
        "a resume does not restore the optimizer's state",
        TR,
        [('            self.optimizer.load_state_dict(state["optimizer"])\n', "")],
        ["tests/test_training_crash.py"],
    ),
    Break(
        "disk-full",
        "a full disk (ENOSPC, RLIMIT_FSIZE): one line naming it",
        "ENOSPC/EFBIG get the generic message",
        CLI,
        [
            (
                "        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):",
                "        if False:",
            )
        ],
        [
            f"{CKT}::test_full_disk_is_one_line_and_keeps_the_checkpoint",
            f"{CKT}::test_file_size_limit_in_a_real_process_is_one_line_and_keeps_the_checkpoint",
        ],
    ),
    Break(
        "keep-previous",
        "full disk, I/O error: the previous checkpoint unchanged byte for byte",
        "a save deletes the old checkpoints before writing the new one",
        CK,
        [
            (
                "    remove_leftovers(out)\n    tmp = Path(",
                "    remove_leftovers(out)\n    prune(out, -1)\n    tmp = Path(",
            )
        ],
        [
            f"{CKT}::test_full_disk_is_one_line_and_keeps_the_checkpoint",
            f"{CKT}::test_io_error_on_write_is_one_line_and_keeps_the_checkpoint",
            f"{CKT}::test_file_size_limit_in_a_real_process_is_one_line_and_keeps_the_checkpoint",
        ],
    ),
    Break(
        "io-one-line",
        "an I/O error, a read-only folder: one line, non-zero exit",
        "other OSErrors escape as a traceback",
        CLI,
        [("    except OSError as exc:\n", "    except ValueError as exc:\n")],
        [
            f"{CKT}::test_io_error_on_write_is_one_line_and_keeps_the_checkpoint",
            f"{CKT}::test_read_only_output_folder_is_one_line_and_keeps_the_checkpoint",
        ],
    ),
    Break(
        "io-cleanup",
        "an I/O error during a save leaves nothing half-written behind",
        "a failed save leaves its hidden folder",
        CK,
        [("        shutil.rmtree(tmp, ignore_errors=True)\n        raise\n", "        raise\n")],
        [f"{CKT}::test_io_error_on_write_is_one_line_and_keeps_the_checkpoint"],
    ),
    # Loading: untrusted files
    # ----------------------------------------------------------------------------
    Break(
        "absurd",
        "a config claiming d_model = 10^9 fails before allocating anything",
        "no size check against the weight files",
        UNTRUSTED_CHECKS,
        [("    if needed > 2 * available:", "    if False:")],
        [f"{UNTRUSTED}::test_absurd_sizes_fail_before_allocating"],
    ),
    Break(
        "sizes",
        "zero or negative sizes: one line",
        "only non-integers refused",
        "src/attnlab/model/config.py",
        [("or isinstance(value, bool) or value <= 0:", "or isinstance(value, bool):")],
        [f"{UNTRUSTED}::test_zero_negative_and_non_integer_sizes"],
    ),
    Break(
        "types",
        "every config field type-checked (a string where a number goes)",
        "no type check",
        "src/attnlab/model/config.py",
        [("        self._check_types()\n", "")],
        [f"{UNTRUSTED}::test_every_config_setting_with_every_hostile_value_loads_or_is_one_line"],
    ),
    Break(
        "dtype",
        "a tensor of the wrong dtype: one line naming it",
        "integer tensors accepted",
        UNTRUSTED_CHECKS,
        [("    if not floating:\n", "    if False:\n")],
        [f"{UNTRUSTED}::test_wrong_dtype_is_named"],
    ),
    Break(
        "shape",
        "a tensor of the wrong shape: one line naming it",
        "no shape check",
        NATIVE,
        [("        if tuple(tensor.shape) != tuple(expected[key].shape):", "        if False:")],
        [f"{UNTRUSTED}::test_wrong_shape_missing_and_extra_tensors_are_named"],
    ),
    Break(
        "missing",
        "a missing tensor: one line naming it",
        "no check for missing tensors",
        NATIVE,
        [("    if missing:\n", "    if False:\n")],
        [f"{UNTRUSTED}::test_wrong_shape_missing_and_extra_tensors_are_named"],
    ),
    Break(
        "extra",
        "an extra tensor: one line naming it",
        "no check for extra tensors",
        NATIVE,
        [("    if unexpected:\n", "    if False:\n")],
        [f"{UNTRUSTED}::test_wrong_shape_missing_and_extra_tensors_are_named"],
    ),
    Break(
        "nan",
        "NaN or infinite weights: a warning naming the tensor",
        "no warning (native format)",
        UNTRUSTED_CHECKS,
        [("    if bad:\n        more =", "    if False:\n        more =")],
        [f"{UNTRUSTED}::test_nan_or_infinite_weights_load_with_a_warning_naming_the_tensor"],
    ),
    Break(
        "offsets-property",
        "a safetensors header that lies about offsets, and (hypothesis) any mutation of a real "
        "checkpoint: a load or one line",
        "safetensors' own error escapes",
        NATIVE,
        [
            (
                "    except (SafetensorError, OSError, ValueError) as exc:",
                "    except (OSError, ValueError) as exc:",
            )
        ],
        [
            f"{UNTRUSTED}::test_a_safetensors_header_lying_about_offsets",
            f"{UNTRUSTED}::test_any_mutation_of_a_real_checkpoint_loads_or_is_one_line",
        ],
    ),
    Break(
        "tokenizer",
        "a tokenizer.json that is not JSON: one line",
        "the library's error escapes",
        "src/attnlab/tokenizer.py",
        [
            (
                "        except Exception as exc:  # the library raises a bare Exception on "
                "malformed JSON",
                "        except ImportError as exc:  # the library raises a bare Exception on "
                "malformed JSON",
            )
        ],
        [f"{UNTRUSTED}::test_a_tokenizer_json_that_is_not_json"],
    ),
    # The explorer
    # ----------------------------------------------------------------------------------------
    Break(
        "fuzz",
        "schemathesis: no 500, every refusal a declared 4xx",
        "a mistake in a request (UserError) answered 500",
        "src/attnlab/explorer/app.py",
        [
            (
                "        status = next((code for kind, code in STATUSES.items() if "
                "isinstance(exc, kind)), 422)",
                "        status = 500",
            )
        ],
        ["tests/test_explorer_fuzz.py::test_the_api_keeps_every_promise_of_its_document"],
    ),
    Break(
        "document",
        "the document declares every status the server can give (413, 422, 503)",
        "503 left out of the document",
        "src/attnlab/explorer/app.py",
        [('status == "503" and not path.startswith(QUEUE_PREFIX)', 'status == "503"')],
        [
            "tests/test_explorer_fuzz.py::test_the_document_declares_every_status_the_server_can_give"
        ],
    ),
    Break(
        "queue-503",
        "a full queue answers 503 with Retry-After at once; the rest succeed",
        "no limit: every request waits its turn",
        QUEUE,
        [("        full = self.admitted >= self.capacity", "        full = False")],
        [f"{QT}::test_the_excess_over_capacity_gets_503_at_once_and_the_rest_succeed"],
    ),
    Break(
        "queue-free",
        "the queue frees its places (no leaked slot)",
        "a finished request keeps its place",
        QUEUE,
        [("            self.admitted -= 1", "            pass")],
        [f"{QT}::test_the_queue_frees_its_places_once_the_work_is_done"],
    ),
    Break(
        "nodelay",
        "the 503 within 50 ms: no 40 ms Nagle/delayed-ACK stall on any answer",
        "the listening socket created without naming TCP (asyncio then leaves Nagle on)",
        "src/attnlab/explorer/server.py",
        [
            (
                "    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)",
                "    sock = socket.socket(family, socket.SOCK_STREAM)",
            )
        ],
        [f"{QT}::test_the_servers_connections_send_at_once_without_waiting_for_an_ack"],
    ),
    Break(
        "encode-in-thread",
        "the 503 within 50 ms: the event loop is never held by encoding a large answer",
        "routes return dicts, which FastAPI encodes in the event loop",
        "src/attnlab/explorer/routers/api.py",
        [
            (
                '    return Response(ENCODER.dump_json(content), media_type="application/json")',
                "    return content",
            )
        ],
        [f"{QT}::test_answers_are_encoded_in_the_routes_thread_not_in_the_event_loop"],
    ),
    Break(
        "nan-json",
        "every answer valid JSON (a NaN sent as null, as FastAPI sends it)",
        "answers encoded by pydantic_core.to_json, which writes NaN",
        "src/attnlab/explorer/routers/api.py",
        [
            (
                '    return Response(ENCODER.dump_json(content), media_type="application/json")',
                '    return Response(__import__("pydantic_core").to_json(content), '
                'media_type="application/json")',
            )
        ],
        [f"{QT}::test_a_nan_in_an_answer_is_sent_as_null_as_fastapi_sends_it"],
    ),
    Break(
        "load-rss",
        "load test: resident memory after within 10 % of before",
        "each model request leaks 1 MiB",
        QUEUE,
        [
            (
                "        if not full:\n            self.admitted += 1",
                "        if not full:\n            self.admitted += 1\n"
                "            self.__dict__.setdefault('leak', []).append(bytearray(2**20))",
            )
        ],
        [f"{QT}::test_the_load_benchmark_holds_at_capacity_and_at_twice_it"],
    ),
    Break(
        "host",
        "a Host that is not a loopback name: 400 (DNS rebinding)",
        "no Host check",
        GUARD,
        [
            (
                "        if not self.any_host and host_name(host) not in self.hosts:",
                "        if False:",
            )
        ],
        [f"{SEC}::test_any_other_host_is_400_on_every_route"],
    ),
    Break(
        "origin",
        "a POST with a cross-site Origin: 403",
        "no Origin check",
        GUARD,
        [
            (
                "            if origin is not None and origin.lower() != "
                'f"{scheme}://{host}".lower():',
                "            if False:",
            )
        ],
        [f"{SEC}::test_a_post_from_another_origin_is_403"],
    ),
    Break(
        "text-plain",
        "a body sent as text/plain is not parsed as JSON",
        "no Content-Type check",
        GUARD,
        [
            (
                '            self.has_body(headers)\n            and headers.get("content-type", '
                '"")',
                '            False\n            and headers.get("content-type", "")',
            )
        ],
        [f"{SEC}::test_a_body_that_is_not_declared_json_is_never_parsed_as_json"],
    ),
    Break(
        "cors",
        "no CORS header ever",
        "a route's Access-Control-* header passes",
        GUARD,
        [('                    if not k.lower().startswith(b"access-control-")\n', "")],
        [f"{SEC}::test_a_cors_header_set_by_a_route_is_dropped"],
    ),
    Break(
        "headers",
        "every response: CSP, nosniff, no-referrer",
        "no security headers added",
        GUARD,
        [
            (
                "                headers += [\n                    (k.encode(), v.encode())\n     "
                "               for k, v in SECURITY_HEADERS.items()\n                    if "
                "k.encode() not in present\n                ]\n",
                "",
            )
        ],
        [f"{SEC}::test_every_response_carries_the_security_headers"],
    ),
    Break(
        "csp",
        "the CSP allows only the page's own origin",
        "default-src *",
        GUARD,
        [("    \"default-src 'self'; img-src", '    "default-src *; img-src')],
        [f"{SEC}::test_the_csp_allows_only_the_pages_own_origin"],
    ),
    Break(
        "csp-browser",
        "the browser tests run under that CSP",
        "script-src 'none' (the page's script blocked)",
        GUARD,
        [("script-src 'self';", "script-src 'none';")],
        [
            "tests/test_explorer_browser.py::test_every_view_renders_on_minilm_with_no_console_errors"
        ],
    ),
    Break(
        "token",
        "beyond loopback: without the token every API call is 403",
        "the token is never checked",
        GUARD,
        [
            (
                "            self.token is not None\n            and not self.public(",
                "            False\n            and not self.public(",
            )
        ],
        [f"{SEC}::test_without_the_token_every_api_call_is_403"],
    ),
    Break(
        "token-cli",
        "--host 0.0.0.0 warns and requires a token",
        "no token for a non-loopback host",
        "src/attnlab/explorer/server.py",
        [("    token = None if is_loopback(host) else new_token()", "    token = None")],
        [
            "tests/test_explorer_cli.py::test_a_host_beyond_this_machine_warns_and_requires_the_printed_token"
        ],
    ),
    # Issue 22: what the README promises holds
    # -------------------------------------------------------------
    Break(
        "run-damaged",
        "every checkpoint damaged: the run's files load only if a manifest vouches for them",
        "the run folder's own files load unverified",
        RUNS,
        [
            (
                "    vouching, problem = model_files_vouched_for(run, [folder for _, folder in "
                "checkpoints])",
                "    vouching, problem = run, ''",
            )
        ],
        [
            f"{CKT}::test_a_run_whose_only_checkpoint_is_damaged_with_its_model_files_is_refused_in_one_line"
        ],
    ),
    Break(
        "run-damaged-warn",
        "... and say what was damaged when they do",
        "no warning",
        RUNS,
        [
            (
                '        warnings.warn(\n            f"every checkpoint of {run} is damaged',
                '        0 and warnings.warn(\n            f"every checkpoint of {run} is damaged',
            )
        ],
        [
            f"{CKT}::test_a_run_whose_only_checkpoint_is_damaged_loads_its_verified_model_files_with_one_warning"
        ],
    ),
    Break(
        "cli-warning",
        "a warning on the command line is one line",
        "Python's warning display",
        CLI,
        [("        warnings.showwarning = one_line_warnings(args.command)\n", "")],
        ["tests/test_cli.py::test_a_warning_is_one_line_naming_the_command_in_a_real_process"],
    ),
    Break(
        "status-409",
        "a next token asked of an encoder: 409, declared",
        "answered 422",
        "src/attnlab/explorer/app.py",
        [
            (
                "STATUSES = {NotFound: 404, Unsupported: 409, TextTooLong: 413}",
                "STATUSES = {NotFound: 404, TextTooLong: 413}",
            )
        ],
        [
            "tests/test_explorer_fuzz.py::test_a_live_explorer_keeps_every_promise_of_its_document_to_a_client"
        ],
    ),
    Break(
        "decode-blas",
        "a decode step of more than 8 rows gives the module path's logits",
        "the bias left out of the BLAS products added to the residual",
        "src/attnlab/generate/kernel_decoder.py",
        [
            (
                "            return lambda: out2.addmm_(x2, w.t()).add_(linear.bias)",
                "            return lambda: out2.addmm_(x2, w.t())",
            )
        ],
        ["tests/test_kernels.py::test_a_decode_step_of_many_rows_gives_the_float64_modules_logits"],
    ),
    Break(
        "inductor",
        "inductor's compiled decode step gives the full forward logits",
        "the compiled few-row product off by 0.1 %",
        "src/attnlab/generate/fast_layers.py",
        [
            (
                "    y = (x.unsqueeze(-2) * weight).sum(-1)\n",
                "    y = (x.unsqueeze(-2) * weight).sum(-1) * 1.001\n",
            )
        ],
        [
            "tests/test_fast_paths.py::test_inductor_compiles_the_decode_step_into_code_that_gives_the_full_forward_logits"
        ],
    ),
    Break(
        "demo-explorer",
        "make demo trains, samples and serves its model until Ctrl-C",
        "the demo's last step fails (the explorer refuses its arguments)",
        "src/attnlab/demo.py",
        [
            (
                "    return explore([str(cfg.out)], port=args.port, also=(REAL_LLM,))",
                "    return explore([str(cfg.out)], port=args.port, also=(REAL_LLM,), queue=0)",
            )
        ],
        ["tests/test_training_demo.py"],
    ),
    Break(
        "readme-drift",
        "every command block of the README runs as written",
        "export-html loses its -o",
        "src/attnlab/explorer/cli.py",
        [
            (
                '        "-o", "--output", required=True, metavar="FILE.html"',
                '        "--output", required=True, metavar="FILE.html"',
            )
        ],
        ["tests/test_readme_commands.py -k the-explorer"],
    ),
    Break(
        "no-compiler",
        "without a C compiler the kernels' tests fail, never skip",
        "no compiler is found",
        "src/attnlab/generate/kernels/builds.py",
        [
            (
                '    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")\n',
                "    found = None\n",
            )
        ],
        ["tests/test_kernels.py::test_rope_kernel_equals_apply_rope"],
    ),
    Break(
        "torch-fallback",
        "no local torch wheel: the CPU build from PyTorch's index",
        "the local wheel always 'seen'",
        "tools/install_torch.py",
        [
            (
                "    return subprocess.run(probe, capture_output=True, text=True).returncode == 0",
                "    return True",
            )
        ],
        ["tests/test_setup.py::test_without_a_local_wheel_the_cpu_build_comes_from_pytorchs_index"],
    ),
    Break(
        "cap-silent",
        "a cap from the environment says what it shortens",
        "capped silently",
        "src/attnlab/env.py",
        [("    if announce:", "    if False:")],
        ["tests/test_env.py::test_max_steps_caps_a_training_run_schedule_and_all"],
    ),
    # Issue 26: the page code as modules -----------------------------------------------------------
    Break(
        "modules-shipped",
        "every page module ships in the package",
        "package data without static/'s folders",
        "pyproject.toml",
        [('"explorer/static/*", "explorer/static/**/*", ', '"explorer/static/*", ')],
        [
            "tests/test_explorer_modules.py::"
            "test_app_js_reaches_every_module_in_static_and_each_ships_in_the_package"
        ],
    ),
    Break(
        "modules-inlined",
        "an exported page runs the same modules, inlined",
        "import lines left as they are",
        "src/attnlab/explorer/page_modules.py",
        [
            (
                'body = re.sub(r"^export\\s+", "", _IMPORT.sub(importing, source), flags=re.M)',
                'body = re.sub(r"^export\\s+", "", source, flags=re.M)',
            )
        ],
        [
            "tests/test_explorer_browser.py::test_the_exported_page_works_from_a_file_with_no_network"
        ],
    ),
    Break(
        "modules-alone",
        "each view module draws its view with core.js alone",
        "the soft dictionary uses a helper it does not import",
        "src/attnlab/explorer/static/views/dict.js",
        [("  patternEncoding,\n  show,\n  softmaxRow,", "  patternEncoding,\n  softmaxRow,")],
        ["tests/test_explorer_modules.py::test_each_view_module_draws_its_view_alone -k dict"],
    ),
    # issue 24: Gemma 3 from GGUF
    Break(
        "gemma3-norms",
        "Gemma 3's norms as the GGUF holds them (1 + w): the file's values, as they are",
        "the 1 added again on loading",
        "src/attnlab/formats/gguf.py",
        [
            (
                "            tensor = torch.from_numpy(values)\n",
                "            tensor = torch.from_numpy(values)\n"
                '            tensor = tensor + float(gguf_arch == "gemma3" and "norm" in name)\n',
            )
        ],
        [GEMMA3 + "::test_tiny_file_matches_transformers_gguf_reader"],
    ),
    Break(
        "gemma3-window-pattern",
        "a window on five blocks of six (llama.cpp's pattern), the sixth global",
        "every block windowed",
        "src/attnlab/model/config.py",
        [("if pattern is not None and layer % pattern == pattern - 1:", "if False:")],
        [
            GEMMA3 + "::test_tiny_file_matches_transformers_gguf_reader",
            "tests/test_model.py::test_decoder_matches_reference -k gemma",
        ],
    ),
    Break(
        "gemma3-window-in-cache",
        "cached decoding keeps each block's window, compiled too (the whole buffer)",
        "the band left out of a whole buffer's key mask",
        "src/attnlab/model/attention.py",
        [("mask = band if mask is None else mask & band", "pass")],
        [GEMMA3 + "::test_each_decode_step_sees_its_blocks_window"],
    ),
    Break(
        "gemma3-sentencepiece",
        "SentencePiece ids equal llama-tokenize's",
        "the lowest-scored joins merge first",
        "src/attnlab/formats/gguf_tokenizer.py",
        [("key=scores.__getitem__, reverse=True", "key=scores.__getitem__, reverse=False")],
        [GEMMA3 + "::test_sentencepiece_equals_llama_cpps_algorithm"],
    ),
    Break(
        "gemma3-special-pieces",
        "Gemma's user-defined pieces (runs of spaces, newlines) split the text first (llama.cpp)",
        "user-defined pieces left to the merges",
        "src/attnlab/formats/gguf_tokenizer.py",
        [
            (
                "            if types[i] in (CONTROL, USER_DEFINED, UNKNOWN)\n",
                "            if types[i] in (CONTROL, UNKNOWN)\n",
            )
        ],
        [GEMMA3 + "::test_sentencepiece_equals_llama_cpps_algorithm"],
    ),
    # Forward passes in C (issue 25, run_with_cache)
    # ---------------------------------------------------------------------------
    Break(
        "inference-tiles",
        "the float32 tiles only from enough rows, where they beat F.linear",
        "the tiles for any number of rows",
        "src/attnlab/generate/fast_layers.py",
        [("            and tile_rows(x, self.weight)\n", "")],
        [
            INFERENCE
            + "::test_kernel_linear_takes_the_tiles_from_enough_rows_and_agrees_with_f_linear"
        ],
    ),
    Break(
        "inference-training",
        "training keeps torch's path: the modules are never swapped with gradients on",
        "the swap ignores whether gradients are wanted",
        "src/attnlab/generate/fast_layers.py",
        [("        torch.is_grad_enabled()\n        or torch.compiler", "        torch.compiler")],
        [INFERENCE + "::test_training_keeps_torchs_path_and_its_gradients"],
    ),
    Break(
        "inference-scores-diagonal",
        "run_with_cache's scores in C: each query sees itself",
        "the diagonal masked too",
        "src/attnlab/generate/kernels/c/attention.c",
        [("s0 + j <= t0 + r ? tile_out", "s0 + j < t0 + r ? tile_out")],
        [INFERENCE + " -k attention_steps_equal", INFERENCE + " -k takes_the_kernels"],
    ),
    Break(
        "inference-hooked-scores",
        "the pattern comes from what hook_attn_scores passes on",
        "the pattern from the scores before the hook",
        "src/attnlab/model/attention.py",
        [
            (
                "        scores = self.hook_attn_scores(self.score(q, k, mask=mask, "
                "window=window))\n"
                "        pattern = self.hook_pattern(self.weigh(scores))\n",
                "        scores = self.score(q, k, mask=mask, window=window)\n"
                "        pattern = self.weigh(scores)\n"
                "        scores = self.hook_attn_scores(scores)\n"
                "        pattern = self.hook_pattern(pattern)\n",
            )
        ],
        [INFERENCE + "::test_hooks_that_edit_scores_and_patterns_change_both_paths_alike"],
    ),
    Break(
        "hooks-that-only-read",
        "the steps fuse only where every hook on them only reads",
        "every hook counted as one that only reads",
        "src/attnlab/lens/hooks.py",
        [
            (
                '        return all(getattr(hook, "reads_only", False) for hook in '
                "self._forward_hooks.values())\n",
                "        return True\n",
            )
        ],
        ["tests/test_amx.py::test_a_hook_point_says_whether_its_hooks_only_read"],
    ),
    Break(
        "outputs-past-the-caches",
        "a cache's outputs written past the caches hold the same numbers",
        "the streamed copy leaves out its first 16 floats",
        "src/attnlab/generate/kernels/c/amx.c",
        [
            (
                "    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(",
                "    for (int64_t j = 16; j < n; j += 16) _mm512_stream_ps(",
            )
        ],
        [
            "tests/test_amx.py -k outputs_on_fresh_pages",
            "tests/test_amx.py -k three_attention_steps_in_one_call",
        ],
    ),
    Break(
        "amx-scratch-widest-panel",
        "matrices that share x get the scratch of their widest panel",
        "the scratch of the largest d_out",
        "src/attnlab/generate/kernels/products.py",
        [
            (
                "_kept_scratch(max(needs(rows, d_in, w.shape[0], threads) for w, _ in matrices))",
                "_kept_scratch(needs(rows, d_in, max(w.shape[0] for w, _ in matrices), threads))",
            )
        ],
        ["tests/test_amx.py::test_matrices_that_share_x_ask_for_the_widest_panel_s_scratch"],
    ),
    Break(
        "quality-bos-first",
        "the quality chunks begin with BOS where the tokenizer puts it (llama-perplexity's chunks)",
        "the chunks keep their first text token",
        "benchmarks/blocks_speed.py",
        [("            chunk[0, 0] = bos[0]", "            pass")],
        [
            "tests/test_benchmarks.py::"
            "test_blocks_quality_cuts_chunks_as_llama_perplexity_and_states_their_spread"
        ],
    ),
]


def copy_tree(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)
        else:
            shutil.copy2(source, target / name)


def edits_of(item: Break) -> list[tuple[str, str, str]]:
    """The break's edits as (file, text that must occur exactly once, what it becomes)."""
    return [edit if len(edit) == 3 else (item.file, *edit) for edit in item.edits]


def apply(root: Path, item: Break) -> str | None:
    """Apply the break's edits in the copy; the problem if one does not match exactly once."""
    for file, old, new in edits_of(item):
        path = root / file
        text = path.read_text(encoding="utf-8")
        if text.count(old) != 1:
            return f"the edit matches {text.count(old)} times in {file}: {old.strip()[:60]!r}"
        path.write_text(text.replace(old, new), encoding="utf-8")
    return None


def run_break(item: Break, timeout: float) -> tuple[bool, str, float]:
    """(seen, what happened, seconds)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"break-{item.name}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        problem = apply(root, item)
        if problem:
            return False, problem, 0.0
        outcomes = []
        for test in item.tests:
            node, _, keyword = test.partition(" -k ")
            command = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "--timeout",
                str(int(timeout)),
                node,
                *(["-k", keyword] if keyword else []),
            ]
            env = {**os.environ, "PYTHONPATH": str(root / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
            try:
                done = subprocess.run(
                    command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout + 60
                )
                code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()
            except subprocess.TimeoutExpired:
                code, tail = -1, ["timed out"]
            summary = next(
                (
                    line
                    for line in reversed(tail)
                    if " passed" in line or " failed" in line or "error" in line
                ),
                tail[-1] if tail else "",
            ).strip("= ")
            why = next(
                (line[1:].strip() for line in tail if line.startswith("E ") and line[1:].strip()),
                "",
            )
            outcomes.append((code, summary + (f": {why[:110]}" if why and code == 1 else "")))
    seen = all(code == 1 for code, _ in outcomes)
    return seen, "; ".join(summary for _, summary in outcomes), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", help="run the breaks whose name contains one of these words"
    )
    parser.add_argument("--list", action="store_true", help="list the breaks and stop")
    parser.add_argument("--timeout", type=float, default=900, help="per test run, seconds")
    args = parser.parse_args()
    chosen = [b for b in BREAKS if not args.only or any(word in b.name for word in args.only)]
    if args.list:
        for b in chosen:
            print(f"{b.name:14} {b.promise}  <-  {b.how}")
        return 0
    print(f"# {len(chosen)} breaks, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| promise | test | break | failed |")
    print("| --- | --- | --- | --- |")
    unseen = 0
    for item in chosen:
        seen, what, seconds = run_break(item, args.timeout)
        unseen += not seen
        tests = ", ".join(f"`{t.split('::')[-1] if '::' in t else t}`" for t in item.tests)
        what = what.replace("|", "\\|")
        print(
            f"| {item.promise} | {tests} | {item.how} | {'yes' if seen else 'NOT SEEN'} ({what}; "
            f"{seconds:.0f} s) |",
            flush=True,
        )
    return 1 if unseen else 0


if __name__ == "__main__":
    sys.exit(main())
