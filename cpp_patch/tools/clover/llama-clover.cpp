// llama-clover: generate with the Clover engine (clover.h) from the command line.
//
//   llama-clover -m M.gguf -p TEXT [--mode auto|ar|diffusion|spec] [--block-size B] [--threshold T] [-n N]
//                [--draft-steps S] [--temp T --top-k K --top-p P -s SEED] [-c N_CTX] [-b N_BATCH] [-t THREADS]
//                [--json] [-v]
//
// Flags that llama.cpp's tools also have keep llama.cpp's names and meanings: -b/--batch-size is the prefill
// chunk (n_batch), never the block size (--block-size). Every number is checked (the whole argument must parse,
// within the flag's range); a bad one prints one line and exits with status 2. --json prints the generate
// output schema shared with clover-cpp and clover-ref (docs/generate-output.schema.json).

#include "clover.h"
#include "clover-cpp.h"
#include "clover-gen-params.h"
#include "clover-input.h"
#include "llama.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void clover_cli_usage(const char * argv0) {
    fprintf(stderr,
        "usage: %s -m MODEL.gguf -p PROMPT [options]\n"
        "  --bd FILE                  block-diffusion sidecar (NAME.bd.gguf) for a trunk-only -m file\n"
        "  --mode auto|ar|diffusion|spec  decoding mode (default auto)\n"
        "  --block-size B             block size (default: the GGUF's ARCH.block_size, else 32)\n"
        "  --threshold T              fill threshold in [0, 1] (default: the calibrated one for B)\n"
        "  --coreset-top-p P          block passes' expert coreset top_p in (0, 1] (default: the GGUF's, 1 = off)\n"
        "  -n, --n-predict, --max-tokens N   tokens to generate (default 64)\n"
        "  --draft-steps S            spec mode: LowConfidence steps before the argmax draft (greedy only)\n"
        "  --temp T, --top-k K, --top-p P, -s/--seed S   sampling (temperature 0 = greedy)\n"
        "  -c, --ctx-size N           context size (default min(n_ctx_train, 4096))\n"
        "  -b, --batch-size N         prefill chunk, llama.cpp's n_batch (default 512)\n"
        "  -t, --threads N            threads (default: the physical cores this process may use)\n"
        "  -ngl, --n-gpu-layers N     layers to offload\n"
        "  -ncmoe, --n-cpu-moe N      keep the MoE experts of the first N layers in host memory\n"
        "  -cmoe, --cpu-moe           keep all MoE experts in host memory\n"
        "  -ot, --override-tensor R=BUFT[,...]  buffer type for tensors matching regex R (repeatable)\n"
        "  -sm, --split-mode none|layer|row     how to split the model across GPUs (default layer)\n"
        "  -ts, --tensor-split N0,N1,...        proportion of the model on each GPU\n"
        "  -mg, --main-gpu I          the GPU for split-mode none (or KV with row)\n"
        "  -fitt, --fit-target MiB    memory each GPU keeps free; a plan that does not fit is refused (-1: off)\n"
        "  --stop ID[,ID..]           end-of-generation ids (default: the vocab's EOG set; 'none' = no stop ids)\n"
        "  --ban ID[,ID..]            ids never produced (the mask token is always banned)\n"
        "  --repeat-penalty R, --presence-penalty P, --frequency-penalty F   penalties over the response's tokens\n"
        "                             (spec 4; default: the GGUF's, else 1, 0, 0 = off)\n"
        "  --grammar GBNF, --grammar-file FILE   constrain the response (llama.cpp's GBNF)\n"
        "  -j, --json-schema SCHEMA   constrain the response to JSON matching the schema\n"
        "  --json                     print text, prompt ids, token ids and stats as one JSON object\n"
        "                             (the schema of docs/generate-output.schema.json)\n"
        "  -v, --verbose              show llama.cpp's log\n", argv0);
}

static bool g_verbose = false;

// A whole-argument integer in [lo, hi], or one line on stderr and exit 2 (atoi would take "8x" as 8 and "x" as 0).
static long clover_cli_int(const char * flag, const char * s, long lo, long hi) {
    errno = 0;
    char * end = nullptr;
    const long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE || v < lo || v > hi) {
        if (hi == LONG_MAX || hi == INT_MAX) {
            fprintf(stderr, "error: %s expects an integer >= %ld, got '%s'\n", flag, lo, s);
        } else {
            fprintf(stderr, "error: %s expects an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        }
        exit(2);
    }
    return v;
}

// A generation parameter's value: the whole argument a number (an integer for an integer field) inside the range of
// its row of the parameter table (clover-gen-params.h, the engine's own), or one line on stderr and exit 2.
static double clover_cli_param(const char * flag, clover_gen_param_id id, const char * s) {
    const bool integer = clover_gen_param(id).integer;
    errno = 0;
    char * end = nullptr;
    const double v = integer ? (double) strtoll(s, &end, 10) : strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !clover_gen_param_ok(id, v)) {
        const bool number = end != s && *end == '\0' && errno != ERANGE;
        fprintf(stderr, "error: %s %s, got '%s'\n", flag,
                (number ? clover_gen_param_broken(id, v) : clover_gen_param_rule(id)).c_str(), s);
        exit(2);
    }
    return v;
}

static bool clover_cli_parse_ids(const std::string & s, std::vector<llama_token> & out) {
    out.clear();
    if (s == "none" || s.empty()) {
        return true;
    }
    size_t i = 0;
    while (i <= s.size()) {
        const size_t j = std::min(s.find(',', i), s.size());
        const std::string item = s.substr(i, j - i);
        char * end = nullptr;
        const long v = strtol(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < 0) {
            return false;
        }
        out.push_back((llama_token) v);
        i = j + 1;
    }
    return true;
}

static void clover_cli_log(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static std::string clover_cli_piece(const llama_vocab * vocab, llama_token t) {
    char buf[256];
    int n = llama_token_to_piece(vocab, t, buf, sizeof(buf), 0, true);
    if (n < 0) {
        std::string s(-n, '\0');
        n = llama_token_to_piece(vocab, t, &s[0], (int) s.size(), 0, true);
        return n < 0 ? std::string() : s.substr(0, n);
    }
    return std::string(buf, n);
}

// valid UTF-8: every byte of an invalid or truncated sequence becomes U+FFFD
static std::string clover_cli_utf8(const std::string & s) {
    std::string out;
    size_t i = 0;
    while (i < s.size()) {
        const unsigned char c = s[i];
        size_t len = 0;
        if (c < 0x80) {
            len = 1;
        } else if ((c & 0xE0) == 0xC0 && c >= 0xC2) {
            len = 2;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3;
        } else if ((c & 0xF8) == 0xF0 && c <= 0xF4) {
            len = 4;
        }
        bool ok = len > 0 && i + len <= s.size();
        for (size_t k = 1; ok && k < len; ++k) {
            ok = ((unsigned char) s[i + k] & 0xC0) == 0x80;
        }
        if (ok) {
            out.append(s, i, len);
            i += len;
        } else {
            out += "\xEF\xBF\xBD";
            i += 1;
        }
    }
    return out;
}

static std::string clover_cli_json_str(const std::string & raw) {
    const std::string s = clover_cli_utf8(raw);
    std::string out = "\"";
    for (unsigned char c : s) {
        switch (c) {
            case '"':  out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n";  break;
            case '\r': out += "\\r";  break;
            case '\t': out += "\\t";  break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    snprintf(buf, sizeof(buf), "\\u%04x", c);
                    out += buf;
                } else {
                    out += (char) c;
                }
        }
    }
    return out + "\"";
}

static std::string clover_cli_json_ids(const std::vector<llama_token> & ids) {
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); ++i) {
        out += (i ? ", " : "") + std::to_string(ids[i]);
    }
    return out + "]";
}

static std::string clover_cli_json_histogram(const int32_t * histogram) {
    std::string out = "{";
    bool first = true;
    for (int i = 0; i < CLOVER_HIST_SIZE; ++i) {
        if (histogram[i]) {
            out += (first ? "\"" : ", \"") + std::to_string(i) + "\": " + std::to_string(histogram[i]);
            first = false;
        }
    }
    return out + "}";
}

struct clover_cli_state {
    const llama_vocab *      vocab;
    std::vector<llama_token> tokens;
    bool                     stream;
};

static bool clover_cli_on_tokens(const llama_token * tokens, int32_t n_tokens, void * user_data) {
    auto * st = (clover_cli_state *) user_data;
    for (int32_t i = 0; i < n_tokens; ++i) {
        st->tokens.push_back(tokens[i]);
        if (st->stream) {
            fputs(clover_cli_piece(st->vocab, tokens[i]).c_str(), stdout);
        }
    }
    if (st->stream) {
        fflush(stdout);
    }
    return true;
}

// llama-clover's options; eparams and gparams point into the strings and vectors after clover_cli_parse
struct clover_cli_args {
    std::string model_path;
    std::string bd_path;
    std::string prompt;
    bool        have_prompt = false;
    bool        json        = false;

    std::vector<llama_token> stop_ids;
    std::vector<llama_token> banned_ids;
    std::string              grammar;
    clover_engine_params eparams = clover_engine_default_params();
    clover_gen_params    gparams = clover_gen_default_params();
    std::string override_tensor;
    std::string tensor_split;
};

// -1 to go on, else the exit status (0 after --help, 2 for bad arguments)
static int clover_cli_parse(int argc, char ** argv, clover_cli_args & a) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const auto next = [&](const char * name) -> const char * {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value\n", name);
                exit(2);
            }
            return argv[++i];
        };
        if (arg == "-m" || arg == "--model") {
            a.model_path = next("-m");
        } else if (arg == "--bd") {
            a.bd_path = next("--bd");
        } else if (arg == "-p" || arg == "--prompt") {
            a.prompt = next("-p");
            a.have_prompt = true;
        } else if (arg == "--mode") {
            const std::string m = next("--mode");
            if (m == "ar") {
                a.gparams.mode = CLOVER_MODE_AR;
            } else if (m == "diffusion") {
                a.gparams.mode = CLOVER_MODE_DIFFUSION;
            } else if (m == "spec") {
                a.gparams.mode = CLOVER_MODE_SPEC;
            } else if (m == "auto") {
                a.gparams.mode = CLOVER_MODE_AUTO;
            } else {
                fprintf(stderr, "error: unknown mode '%s'; choose ar, diffusion, spec or auto\n", m.c_str());
                return 2;
            }
        } else if (arg == "--block-size") {
            a.gparams.block_size = (int32_t) clover_cli_param("--block-size", CLOVER_GEN_PARAM_BLOCK_SIZE, next("--block-size"));
        } else if (arg == "--threshold") {
            a.gparams.threshold = (float) clover_cli_param("--threshold", CLOVER_GEN_PARAM_THRESHOLD, next("--threshold"));
        } else if (arg == "--coreset-top-p") {
            a.gparams.coreset_top_p = (float) clover_cli_param("--coreset-top-p", CLOVER_GEN_PARAM_CORESET_TOP_P,
                    next("--coreset-top-p"));
        } else if (arg == "-n" || arg == "--n-predict" || arg == "--max-tokens") {
            a.gparams.max_tokens = (int32_t) clover_cli_param("-n/--n-predict", CLOVER_GEN_PARAM_MAX_TOKENS, next("-n"));
        } else if (arg == "--draft-steps") {
            a.gparams.draft_steps = (int32_t) clover_cli_param("--draft-steps", CLOVER_GEN_PARAM_DRAFT_STEPS, next("--draft-steps"));
        } else if (arg == "--temp" || arg == "--temperature") {
            a.gparams.temperature = (float) clover_cli_param("--temp", CLOVER_GEN_PARAM_TEMPERATURE, next("--temp"));
        } else if (arg == "--repeat-penalty") {
            a.gparams.repeat_penalty = (float) clover_cli_param("--repeat-penalty", CLOVER_GEN_PARAM_REPEAT_PENALTY,
                    next("--repeat-penalty"));
        } else if (arg == "--presence-penalty") {
            a.gparams.presence_penalty = (float) clover_cli_param("--presence-penalty", CLOVER_GEN_PARAM_PRESENCE_PENALTY,
                    next("--presence-penalty"));
        } else if (arg == "--frequency-penalty") {
            a.gparams.frequency_penalty = (float) clover_cli_param("--frequency-penalty", CLOVER_GEN_PARAM_FREQUENCY_PENALTY,
                    next("--frequency-penalty"));
        } else if (arg == "--grammar") {
            a.grammar = next("--grammar");
        } else if (arg == "--grammar-file") {
            const char * path = next("--grammar-file");
            const std::string problem = clover_read_input_file(path, CLOVER_MAX_GRAMMAR_FILE_BYTES, a.grammar);
            if (!problem.empty()) {
                fprintf(stderr, "error: --grammar-file: '%s': %s\n", path, problem.c_str());
                return 2;
            }
        } else if (arg == "-j" || arg == "--json-schema") {
            char err[512];
            const char * schema = next("--json-schema");
            const int32_t n = clover_json_schema_to_grammar(schema, nullptr, 0, err, sizeof(err));
            if (n < 0) {
                fprintf(stderr, "error: --json-schema: %s\n", err);
                return 2;
            }
            a.grammar.assign((size_t) n + 1, '\0');
            clover_json_schema_to_grammar(schema, a.grammar.data(), a.grammar.size(), err, sizeof(err));
            a.grammar.resize((size_t) n);
        } else if (arg == "--top-k") {
            a.gparams.top_k = (int32_t) clover_cli_param("--top-k", CLOVER_GEN_PARAM_TOP_K, next("--top-k"));
        } else if (arg == "--top-p") {
            a.gparams.top_p = (float) clover_cli_param("--top-p", CLOVER_GEN_PARAM_TOP_P, next("--top-p"));
        } else if (arg == "-s" || arg == "--seed") {
            a.gparams.seed = (uint32_t) clover_cli_int("-s/--seed", next("--seed"), 0, (long) UINT32_MAX);
        } else if (arg == "-c" || arg == "--ctx-size") {
            a.eparams.n_ctx = (int32_t) clover_cli_int("-c/--ctx-size", next("-c"), 0, INT_MAX);
        } else if (arg == "-b" || arg == "--batch-size") {
            a.eparams.n_batch = (int32_t) clover_cli_int("-b/--batch-size", next("-b"), 1, INT_MAX);
        } else if (arg == "-t" || arg == "--threads") {
            a.eparams.n_threads = (int32_t) clover_cli_int("-t/--threads", next("-t"), 0, GGML_MAX_N_THREADS);
        } else if (arg == "-ngl" || arg == "--n-gpu-layers") {
            a.eparams.n_gpu_layers = (int32_t) clover_cli_int("-ngl/--n-gpu-layers", next("-ngl"), -1, INT_MAX);
        } else if (arg == "-ncmoe" || arg == "--n-cpu-moe") {
            a.eparams.n_cpu_moe = (int32_t) clover_cli_int("-ncmoe/--n-cpu-moe", next("--n-cpu-moe"), 0, INT_MAX);
        } else if (arg == "-cmoe" || arg == "--cpu-moe") {
            a.eparams.cpu_moe = true;
        } else if (arg == "-ot" || arg == "--override-tensor") {
            a.override_tensor += (a.override_tensor.empty() ? "" : ",") + std::string(next("-ot"));
        } else if (arg == "-sm" || arg == "--split-mode") {
            const std::string m = next("-sm");
            if (m == "none") {
                a.eparams.split_mode = LLAMA_SPLIT_MODE_NONE;
            } else if (m == "layer") {
                a.eparams.split_mode = LLAMA_SPLIT_MODE_LAYER;
            } else if (m == "row") {
                a.eparams.split_mode = LLAMA_SPLIT_MODE_ROW;
            } else {
                fprintf(stderr, "error: -sm/--split-mode must be none, layer or row, got '%s'\n", m.c_str());
                return 2;
            }
        } else if (arg == "-ts" || arg == "--tensor-split") {
            a.tensor_split = next("-ts");
        } else if (arg == "-mg" || arg == "--main-gpu") {
            a.eparams.main_gpu = (int32_t) clover_cli_int("-mg/--main-gpu", next("-mg"), 0, INT_MAX);
        } else if (arg == "-fitt" || arg == "--fit-target") {
            a.eparams.fit_margin_mib = (int32_t) clover_cli_int("-fitt/--fit-target", next("--fit-target"), -1, INT_MAX);
        } else if (arg == "--stop" || arg == "--ban") {
            const bool is_stop = arg == "--stop";
            if (!clover_cli_parse_ids(next(arg.c_str()), is_stop ? a.stop_ids : a.banned_ids)) {
                fprintf(stderr, "error: %s expects comma-separated token ids\n", arg.c_str());
                return 2;
            }
            if (is_stop) {
                a.gparams.n_stop_ids = (int32_t) a.stop_ids.size();
            } else {
                a.gparams.n_banned_ids = (int32_t) a.banned_ids.size();
            }
        } else if (arg == "--json") {
            a.json = true;
        } else if (arg == "-v" || arg == "--verbose") {
            g_verbose = true;
        } else if (arg == "-h" || arg == "--help") {
            clover_cli_usage(argv[0]);
            return 0;
        } else {
            fprintf(stderr, "error: unknown argument '%s'\n", arg.c_str());
            clover_cli_usage(argv[0]);
            return 2;
        }
    }
    if (a.model_path.empty() || !a.have_prompt) {
        clover_cli_usage(argv[0]);
        return 2;
    }
    a.gparams.grammar    = a.grammar.empty() ? nullptr : a.grammar.c_str();
    a.gparams.stop_ids   = a.stop_ids.data();
    a.gparams.banned_ids = a.banned_ids.data();
    a.eparams.override_tensor = a.override_tensor.empty() ? nullptr : a.override_tensor.c_str();
    a.eparams.tensor_split    = a.tensor_split.empty() ? nullptr : a.tensor_split.c_str();
    a.eparams.bd_path         = a.bd_path.empty() ? nullptr : a.bd_path.c_str();
    return -1;
}

// the prompt's token ids (special tokens parsed), empty when it tokenizes to nothing or fails
static std::vector<llama_token> clover_cli_tokenize(const llama_vocab * vocab, const std::string & prompt) {
    std::vector<llama_token> ids(prompt.size() + 16);
    int32_t n = llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), ids.data(), (int32_t) ids.size(), false, true);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), ids.data(), (int32_t) ids.size(), false, true);
    }
    ids.resize(std::max(n, 0));
    return ids;
}

static const char * clover_cli_mode_name(int32_t mode) {
    static const char * names[] = { "ar", "diffusion", "spec", "auto" };
    return mode >= 0 && mode <= 3 ? names[mode] : "";
}

static const char * clover_cli_stop_name(int32_t reason) {
    static const char * names[] = { "", "length", "eos", "context", "cancelled" };
    return reason >= 0 && reason <= 4 ? names[reason] : "";
}

// --json: the generate output schema shared with clover-cpp and clover-ref (docs/generate-output.schema.json,
// clover_ref/generate_output.py): same keys, same formulas
static void clover_cli_print_json(const llama_vocab * vocab, const std::vector<llama_token> & prompt_ids,
                                  const std::vector<llama_token> & tokens,
                                  const clover_stats & stats, int32_t n_threads) {
    std::string text;
    for (llama_token t : tokens) {
        text += clover_cli_piece(vocab, t);
    }
    const int32_t n_out  = (int32_t) tokens.size();
    const int32_t passes = stats.n_block_passes + stats.n_causal_passes;
    const double  t_gen  = stats.t_block_ms + stats.t_causal_ms;
    printf("{\"text\": %s, \"prompt_ids\": %s, \"tokens\": %s, \"stats\": {"
           "\"mode\": \"%s\", \"block_size\": %d, \"threshold\": %.9g, \"prompt_tokens\": %d, "
           "\"generated_tokens\": %d, \"block_passes\": %d, \"causal_passes\": %d, \"tokens_per_pass\": %.17g, "
           "\"prefill_ms\": %.17g, \"decode_ms\": %.17g, \"prefill_tok_per_s\": %.17g, \"decode_tok_per_s\": %.17g, "
           "\"steps_per_block\": %s, \"accepted_lengths\": %s, \"stop_reason\": \"%s\", "
           "\"threads\": %d, \"block_ms\": %.17g, \"causal_ms\": %.17g, \"coreset_top_p\": %.9g}}\n",
           clover_cli_json_str(text).c_str(), clover_cli_json_ids(prompt_ids).c_str(),
           clover_cli_json_ids(tokens).c_str(), clover_cli_mode_name(stats.mode), stats.block_size, (double) stats.threshold,
           stats.n_prompt_tokens, n_out, stats.n_block_passes, stats.n_causal_passes,
           passes ? (double) n_out / passes : 0.0, stats.t_prefill_ms, t_gen,
           stats.t_prefill_ms > 0 ? stats.n_prompt_tokens / (stats.t_prefill_ms / 1000.0) : 0.0,
           t_gen > 0 ? n_out / (t_gen / 1000.0) : 0.0,
           clover_cli_json_histogram(stats.steps_per_block).c_str(), clover_cli_json_histogram(stats.accepted_lengths).c_str(),
           clover_cli_stop_name(stats.stop_reason), n_threads, stats.t_block_ms, stats.t_causal_ms,
           (double) stats.coreset_top_p);
}

int main(int argc, char ** argv) {
#ifndef _WIN32
    // ggml's abort hook attaches gdb for a backtrace, which can hang for minutes under a supervisor; ggml reads this
    // again when it aborts, so setting it here (unless the user chose) is enough. A malformed GGUF is refused
    // before any abort anyway.
    setenv("GGML_NO_BACKTRACE", "1", 0);
#endif
    clover_cli_args a;
    const int parsed = clover_cli_parse(argc, argv, a);
    if (parsed >= 0) {
        return parsed;
    }
    llama_log_set(clover_cli_log, nullptr);

    char err[1024] = {0};
    clover_model_info info;
    // what the user named and gave is checked before any decoding: a file or value at fault exits 2, as a bad flag
    if (clover_model_info_read(a.model_path.c_str(), a.eparams.bd_path, &info, err, sizeof(err)) != 0) {
        fprintf(stderr, "error: %s\n", err);
        return 2;
    }
    if (a.eparams.max_block_size == 0 && a.gparams.block_size > 0) {
        int32_t mb = std::max(info.block_size, a.gparams.block_size);
        for (int32_t i = 0; i < info.n_calibrated; ++i) {
            mb = std::max(mb, info.calibrated_block_sizes[i]);
        }
        a.eparams.max_block_size = mb;
    }
    clover_engine_ptr eng(clover_engine_load(a.model_path.c_str(), a.eparams, err, sizeof(err)));
    if (!eng) {
        fprintf(stderr, "error: %s\n", err);
        return 2;
    }
    if (!a.grammar.empty() && clover_engine_check_grammar(eng.get(), a.grammar.c_str(), nullptr, err, sizeof(err)) != 0) {
        fprintf(stderr, "error: %s\n", err);
        return 2;
    }
    const llama_vocab * vocab = llama_model_get_vocab(clover_engine_model(eng.get()));
    const std::vector<llama_token> prompt_ids = clover_cli_tokenize(vocab, a.prompt);
    if (prompt_ids.empty()) {
        fprintf(stderr, "error: the prompt is empty after tokenization (or tokenization failed)\n");
        return 1;
    }

    clover_cli_state st = { vocab, {}, !a.json };
    clover_stats stats;
    clover_slot * slot = clover_engine_slot(eng.get(), 0);
    if (clover_slot_generate(slot, prompt_ids.data(), (int32_t) prompt_ids.size(), &a.gparams, clover_cli_on_tokens,
                             nullptr, &st, &stats) < 0) {
        fprintf(stderr, "error: %s\n", clover_slot_last_error(slot));
        return 1;
    }
    const int32_t n_threads = clover_engine_n_threads(eng.get());
    if (a.json) {
        clover_cli_print_json(vocab, prompt_ids, st.tokens, stats, n_threads);
    } else {
        const int32_t passes = stats.n_block_passes + stats.n_causal_passes;
        const double  t_gen  = stats.t_block_ms + stats.t_causal_ms;
        printf("\n");
        fprintf(stderr, "[%s] %d tokens, %d block + %d causal passes, %.2f tokens/pass, %.1f tok/s, %d threads, stop: %s\n",
                clover_cli_mode_name(stats.mode), stats.n_generated, stats.n_block_passes, stats.n_causal_passes,
                passes ? (double) stats.n_generated / passes : 0.0, t_gen > 0 ? stats.n_generated / (t_gen / 1000.0) : 0.0,
                n_threads, clover_cli_stop_name(stats.stop_reason));
    }
    return 0;
}
