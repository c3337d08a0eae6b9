// Where the weights go: llama.cpp's -ot/--override-tensor, --cpu-moe, --n-cpu-moe, -sm, -mg and -ts as fields of
// clover_engine_params, resolved into llama_model_params (tensor_buft_overrides, split_mode, main_gpu,
// tensor_split) with the same names, syntax and regexes as llama.cpp's common/arg.cpp; and the memory plan of a
// load (llama.cpp's own no_alloc dry run, as its --fit does) with the check that refuses a plan that does not fit.
// docs/native.md, "A 35B on one 24 GB GPU".

#include "clover.h"
#include "clover-log.h"
#include "clover-offload.h"

#include "common.h"     // LLM_FFN_EXPS_REGEX, llm_ffn_block_regex: --n-cpu-moe's patterns, not a copy of them
#include "ggml-backend.h"
#include "llama.h"
#include "../../src/llama-ext.h"  // llama_get_memory_breakdown, llama_model_n_devices (llama.cpp's fit uses them)

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <string>
#include <vector>

#ifndef _WIN32
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cerrno>
#include <fcntl.h>
#endif

static constexpr int64_t CLOVER_MIB = 1024 * 1024;

// the buffer types -ot accepts: each device's default buffer type, by name (llama.cpp's parse_tensor_buffer_overrides)
static std::map<std::string, ggml_backend_buffer_type_t> clover_buft_names() {
    std::map<std::string, ggml_backend_buffer_type_t> out;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_get(i));
        if (buft) {
            out[ggml_backend_buft_name(buft)] = buft;
        }
    }
    return out;
}

// the CPU device's buffer type, looked up in the registry: ggml_backend_cpu_buffer_type() is a symbol of ggml-cpu,
// which a GGML_BACKEND_DL build loads at run time instead of linking
static ggml_backend_buffer_type_t clover_cpu_buft() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return cpu ? ggml_backend_dev_buffer_type(cpu) : nullptr;
}

int32_t clover_n_gpu_devices() {
    int32_t n = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const auto type = ggml_backend_dev_type(ggml_backend_dev_get(i));
        n += type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU;
    }
    return n;
}

static std::vector<std::string> clover_split(const std::string & s, const char * seps) {
    std::vector<std::string> out;
    size_t start = 0;
    while (true) {
        const size_t end = s.find_first_of(seps, start);
        out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
        if (end == std::string::npos) {
            return out;
        }
        start = end + 1;
    }
}

bool clover_offload_resolve(const clover_engine_params & p, int32_t n_layer, clover_offload & out, std::string & err) {
    out = clover_offload();
    const auto add = [&](std::string pattern, ggml_backend_buffer_type_t buft) {
        out.patterns.push_back(std::move(pattern));
        out.overrides.push_back({ out.patterns.back().c_str(), buft });
    };

    // -ot first: llama.cpp takes the first pattern that matches a tensor, in the order of the command line, and
    // its tools parse -ot before --cpu-moe / --n-cpu-moe only when given first; ours are always in this order
    if (p.override_tensor && *p.override_tensor) {
        const auto bufts = clover_buft_names();
        for (const std::string & item : clover_split(p.override_tensor, ",")) {
            const size_t eq = item.find('=');
            if (eq == std::string::npos || eq == 0) {
                err = clover_format("override_tensor (-ot): '%s' is not <tensor name regex>=<buffer type>", item.c_str());
                return false;
            }
            const std::string pattern = item.substr(0, eq);
            const std::string name    = item.substr(eq + 1);
            try {
                std::regex rx(pattern);
            } catch (const std::regex_error & e) {
                err = clover_format("override_tensor (-ot): '%s' is not a valid regex (%s)", pattern.c_str(), e.what());
                return false;
            }
            const auto it = bufts.find(name);
            if (it == bufts.end()) {
                std::string avail;
                for (const auto & b : bufts) {
                    avail += (avail.empty() ? "" : ", ") + b.first;
                }
                err = clover_format("override_tensor (-ot): unknown buffer type '%s' (available: %s)", name.c_str(),
                                    avail.c_str());
                return false;
            }
            add(pattern, it->second);
        }
    }
    if (p.n_cpu_moe < 0) {
        err = clover_format("n_cpu_moe (--n-cpu-moe) must be >= 0, got %d", p.n_cpu_moe);
        return false;
    }
    if (p.n_cpu_moe > n_layer) {
        err = clover_format("n_cpu_moe (--n-cpu-moe) %d exceeds the model's %d layers", p.n_cpu_moe, n_layer);
        return false;
    }
    if (p.cpu_moe) {  // llama.cpp's llm_ffn_exps_cpu_override()
        add(LLM_FFN_EXPS_REGEX, clover_cpu_buft());
    }
    for (int32_t il = 0; il < p.n_cpu_moe; ++il) {  // llama.cpp's llm_add_n_cpu_ffn_overrides()
        add(llm_ffn_block_regex(il, LLM_FFN_EXPS_REGEX), clover_cpu_buft());
    }
    if (!out.overrides.empty()) {
        out.overrides.push_back({ nullptr, nullptr });
    }

    const int32_t n_gpu = clover_n_gpu_devices();
    switch (p.split_mode) {
        case -1:                     out.split_mode = LLAMA_SPLIT_MODE_LAYER; break;
        case LLAMA_SPLIT_MODE_NONE:
        case LLAMA_SPLIT_MODE_LAYER:
        case LLAMA_SPLIT_MODE_ROW:   out.split_mode = (llama_split_mode) p.split_mode; break;
        default:
            // LLAMA_SPLIT_MODE_TENSOR is refused for clover by llama.cpp itself (llm_arch_supports_sm_tensor)
            err = clover_format("split_mode (-sm) %d is not one of none (0), layer (1), row (2)", p.split_mode);
            return false;
    }
    if (p.main_gpu < 0 || (p.main_gpu > 0 && p.main_gpu >= n_gpu)) {
        err = clover_format("main_gpu (-mg) %d: this build has %d GPU device%s", p.main_gpu, n_gpu, n_gpu == 1 ? "" : "s");
        return false;
    }
    out.main_gpu = p.main_gpu;

    if (p.tensor_split && *p.tensor_split) {
        const std::vector<std::string> parts = clover_split(p.tensor_split, ",/");  // llama.cpp splits at , and /
        std::vector<float> split;
        for (const std::string & s : parts) {
            char * end = nullptr;
            const float v = s.empty() ? -1.0f : strtof(s.c_str(), &end);
            if (s.empty() || *end != '\0' || !(v >= 0.0f) || !std::isfinite(v)) {
                err = clover_format("tensor_split (-ts) '%s': '%s' is not a proportion >= 0", p.tensor_split, s.c_str());
                return false;
            }
            split.push_back(v);
        }
        if ((int32_t) split.size() > n_gpu) {
            err = clover_format("tensor_split (-ts) '%s' has %zu entries, but this build has %d GPU device%s",
                                p.tensor_split, split.size(), n_gpu, n_gpu == 1 ? "" : "s");
            return false;
        }
        if (std::all_of(split.begin(), split.end(), [](float v) { return v == 0.0f; })) {
            err = clover_format("tensor_split (-ts) '%s' gives every GPU 0", p.tensor_split);
            return false;
        }
        out.tensor_split.assign(llama_max_devices(), 0.0f);
        std::copy(split.begin(), split.end(), out.tensor_split.begin());
    }
    return true;
}

void clover_offload::apply(llama_model_params & mp) const {
    mp.tensor_buft_overrides = overrides.empty() ? nullptr : overrides.data();
    mp.split_mode            = split_mode;
    mp.main_gpu              = main_gpu;
    mp.tensor_split          = tensor_split.empty() ? nullptr : tensor_split.data();
}

static void clover_copy_name(char * dst, size_t size, const char * src) {
    snprintf(dst, size, "%s", src ? src : "");
}

// llama.cpp's common_get_device_memory_data without its log table: load with no_alloc (no tensor data is read or
// allocated), create the context, and sum llama_get_memory_breakdown per device; host buffers go to the last entry
bool clover_plan_memory(const char * path, const llama_model_params & mparams, const llama_context_params & cparams,
                        std::vector<clover_device_memory> & out, std::string & err) {
    llama_model_params mp = mparams;
    mp.no_alloc  = true;
    mp.load_mode = LLAMA_LOAD_MODE_NONE;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        err = clover_format("failed to load model '%s' for the memory plan (see llama.cpp's log)", path);
        return false;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        llama_model_free(model);
        err = "failed to create the llama context for the memory plan (see llama.cpp's log)";
        return false;
    }
    const int32_t nd = llama_model_n_devices(model);
    out.assign(nd + 1, clover_device_memory{});
    for (int32_t i = 0; i < nd; ++i) {
        ggml_backend_dev_t dev = llama_model_get_device(model, i);
        clover_copy_name(out[i].name, sizeof(out[i].name), ggml_backend_dev_name(dev));
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(dev, &free, &total);
        out[i].free  = (int64_t) free;
        out[i].total = (int64_t) total;
    }
    clover_device_memory & host = out.back();
    clover_copy_name(host.name, sizeof(host.name), "Host");
    host.is_host = true;
    if (ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)) {
        size_t free = 0, total = 0;
        ggml_backend_dev_memory(cpu, &free, &total);
        host.free  = (int64_t) free;
        host.total = (int64_t) total;
    }
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        clover_device_memory * d = nullptr;
        if (ggml_backend_buft_is_host(buft)) {
            d = &host;
        } else if (ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft)) {
            for (int32_t i = 0; i < nd; ++i) {
                if (dev == llama_model_get_device(model, i)) {
                    d = &out[i];
                }
            }
        }
        if (d) {
            d->model   += (int64_t) mb.model;
            d->context += (int64_t) mb.context;
            d->compute += (int64_t) mb.compute;
        }
    }
    llama_free(ctx);
    llama_model_free(model);
    return true;
}

// MemAvailable of /proc/meminfo (what can be allocated without swapping; the page cache of mmapped weights
// counts as available), or `fallback` where there is none: ggml's CPU device reports all physical memory as free
static int64_t clover_host_available(int64_t fallback) {
    FILE * f = fopen("/proc/meminfo", "r");
    if (!f) {
        return fallback;
    }
    char line[256];
    long long kib = -1;
    while (fgets(line, sizeof(line), f)) {
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) {
            break;
        }
    }
    fclose(f);
    return kib >= 0 ? (int64_t) kib * 1024 : fallback;
}

bool clover_check_host_fit(const std::vector<clover_device_memory> & devs, int32_t margin_mib, int32_t n_parallel,
                           std::string & err) {
    for (const clover_device_memory & d : devs) {
        if (!d.is_host) {
            continue;  // the weights are mmapped (the page cache holds them); the context and compute buffers are not
        }
        const int64_t avail = clover_host_available(d.free);
        const int64_t need  = d.context + d.compute;
        const int64_t have  = avail - (int64_t) std::max(margin_mib, 0) * CLOVER_MIB;
        if (need > have) {
            err = clover_format("%d slots do not fit host memory: their context needs %.0f MiB (KV cache and recurrent "
                                "state %.0f, compute %.0f MiB), %.0f MiB are available, %d MiB of it kept free "
                                "(fit_margin_mib, --fit-target); use fewer slots (-np), a smaller -c or --max-block-size",
                                n_parallel, need / (double) CLOVER_MIB, d.context / (double) CLOVER_MIB,
                                d.compute / (double) CLOVER_MIB, avail / (double) CLOVER_MIB, std::max(margin_mib, 0));
            return false;
        }
    }
    return true;
}

// ggml-rpc aborts the process when it cannot connect (rpc_dispatcher::start), so each endpoint is probed first: ""
// when a TCP connection to host:port opens within timeout_ms, else why not
static std::string clover_rpc_probe(const std::string & endpoint, int timeout_ms) {
#ifdef _WIN32
    (void) endpoint; (void) timeout_ms;
    return "";
#else
    const size_t colon = endpoint.rfind(':');
    const std::string host = endpoint.substr(0, colon);
    const std::string port = endpoint.substr(colon + 1);
    addrinfo hints = {};
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
        return clover_format("cannot resolve '%s' (%s)", host.c_str(), gai_strerror(rc));
    }
    std::string why = "no address";
    for (addrinfo * ai = res; ai; ai = ai->ai_next) {
        const int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) {
            why = strerror(errno);
            continue;
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
            pollfd pfd = { fd, POLLOUT, 0 };
            rc = poll(&pfd, 1, timeout_ms) == 1 ? 0 : -1;
            int so_error = rc == 0 ? 0 : ETIMEDOUT;
            socklen_t len = sizeof(so_error);
            if (rc == 0) {
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
            }
            errno = so_error;
            rc = so_error == 0 ? 0 : -1;
        }
        why = rc == 0 ? "" : strerror(errno);
        close(fd);
        if (rc == 0) {
            break;
        }
    }
    freeaddrinfo(res);
    return why;
#endif
}

extern "C" {

int32_t clover_rpc_add_servers(const char * servers, char * err, size_t err_size) {
    static std::mutex mutex;
    static std::set<std::string> added;  // the backend registry has no removal: never register an endpoint twice
    const auto fail = [&](const std::string & msg) {
        if (err && err_size > 0) {
            snprintf(err, err_size, "--rpc: %s", msg.c_str());
        }
        return -1;
    };
    if (!servers || !*servers) {
        return fail("no RPC servers given (host:port[,host:port...])");
    }
    const std::vector<std::string> endpoints = clover_split(servers, ",");
    for (const std::string & ep : endpoints) {
        const size_t colon = ep.rfind(':');
        if (colon == std::string::npos || colon == 0 || colon + 1 == ep.size() ||
            ep.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
            return fail(clover_format("'%s' is not host:port", ep.c_str()));
        }
    }
    ggml_backend_reg_t rpc_reg = ggml_backend_reg_by_name("RPC");
    if (!rpc_reg) {
        ggml_backend_load_all();  // a GGML_BACKEND_DL build loads ggml-rpc as a module
        rpc_reg = ggml_backend_reg_by_name("RPC");
    }
    if (!rpc_reg) {
        return fail("this build has no RPC backend (build with -DGGML_RPC=ON)");
    }
    typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
    const auto add_server = (add_server_t) ggml_backend_reg_get_proc_address(rpc_reg, "ggml_backend_rpc_add_server");
    if (!add_server) {
        return fail("the RPC backend has no ggml_backend_rpc_add_server");
    }
    std::lock_guard<std::mutex> lock(mutex);
    int32_t n_added = 0;
    for (const std::string & ep : endpoints) {
        if (added.count(ep)) {
            continue;
        }
        if (const std::string why = clover_rpc_probe(ep, 5000); !why.empty()) {
            return fail(clover_format("cannot connect to an rpc-server at %s: %s", ep.c_str(), why.c_str()));
        }
        ggml_backend_reg_t reg = add_server(ep.c_str());
        if (!reg || ggml_backend_reg_dev_count(reg) == 0) {
            return fail(clover_format("cannot reach an rpc-server at %s", ep.c_str()));
        }
        ggml_backend_register(reg);
        added.insert(ep);
        n_added += (int32_t) ggml_backend_reg_dev_count(reg);
    }
    if (err && err_size > 0) {
        err[0] = '\0';
    }
    return n_added;
}

int32_t clover_check_fit(const struct clover_device_memory * devs, int32_t n_devs, int32_t margin_mib,
                         char * err, size_t err_size) {
    std::string msg;
    for (int32_t i = 0; devs && i < n_devs; ++i) {
        const clover_device_memory & d = devs[i];
        if (d.is_host || (d.free == 0 && d.total == 0)) {
            continue;  // host memory: weights are mmapped; a device that reports nothing cannot be checked
        }
        const int64_t need = d.model + d.context + d.compute;
        const int64_t have = d.free - (int64_t) std::max(margin_mib, 0) * CLOVER_MIB;
        if (need > have) {
            const std::string free = d.free >= 1024 * CLOVER_MIB
                ? clover_format("%.1f GiB", d.free / (double) (1024 * CLOVER_MIB))
                : clover_format("%.0f MiB", d.free / (double) CLOVER_MIB);
            msg += clover_format("%sneeds %.0f MiB on %s (weights %.0f, context %.0f, compute %.0f MiB), %s free, "
                                 "%d MiB of it kept free (fit_margin_mib, --fit-target)", msg.empty() ? "" : "; ",
                                 need / (double) CLOVER_MIB, d.name, d.model / (double) CLOVER_MIB,
                                 d.context / (double) CLOVER_MIB, d.compute / (double) CLOVER_MIB, free.c_str(),
                                 std::max(margin_mib, 0));
        }
    }
    if (!msg.empty()) {
        if (err && err_size > 0) {
            snprintf(err, err_size, "the model does not fit: %s (lower -ngl, raise --n-cpu-moe, or use -ot)",
                     msg.c_str());
        }
        return -1;
    }
    if (err && err_size > 0) {
        err[0] = '\0';
    }
    return 0;
}

}  // extern "C"
