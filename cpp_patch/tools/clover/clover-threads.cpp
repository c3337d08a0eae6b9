// The engine's default thread count: the physical cores this process may run on.
//
// llama_context_default_params() asks for 4 threads whatever the machine. On a 2-core machine the two extra
// threads are descheduled while every op waits for them at its barrier (the demo model decoded at 66 tok/s
// with 4 threads against 1898 with 2); on a 16-core workstation 4 threads leave most of the memory bandwidth
// unused. So the default counts the CPUs in the affinity mask (taskset, cpusets), counts SMT siblings once
// (they share the core's execution units and bandwidth), and caps the result by the cgroup CPU quota
// (docker --cpus, systemd CPUQuota).

#include "clover.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__linux__)
static bool clover_read_long(const std::string & path, long & out) {
    FILE * f = fopen(path.c_str(), "r");
    if (!f) {
        return false;
    }
    const bool ok = fscanf(f, "%ld", &out) == 1;
    fclose(f);
    return ok;
}

// CPUs allowed by the cgroup v2 cpu.max or v1 cfs quota; 0 when unlimited or unknown
static int32_t clover_cgroup_cpu_limit() {
    if (FILE * f = fopen("/sys/fs/cgroup/cpu.max", "r")) {
        char quota[32] = {};
        long period = 0;
        const int n = fscanf(f, "%31s %ld", quota, &period);
        fclose(f);
        if (n == 2 && std::string(quota) != "max" && period > 0) {
            return (int32_t) std::max(1.0, std::floor(std::stod(quota) / (double) period));
        }
        return 0;
    }
    long quota = 0;
    long period = 0;
    if (clover_read_long("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", quota) &&
        clover_read_long("/sys/fs/cgroup/cpu/cpu.cfs_period_us", period) && quota > 0 && period > 0) {
        return (int32_t) std::max(1L, quota / period);
    }
    return 0;
}
#endif

extern "C" int32_t clover_default_n_threads(void) {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        std::set<std::pair<long, long>> cores;  // (package, core) of each allowed CPU
        for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
            if (!CPU_ISSET(cpu, &set)) {
                continue;
            }
            const std::string topo = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
            long package = 0;
            long core = 0;
            if (clover_read_long(topo + "physical_package_id", package) && clover_read_long(topo + "core_id", core)) {
                cores.emplace(package, core);
            } else {
                cores.emplace(-1, cpu);  // no topology: count the CPU itself
            }
        }
        int32_t n = (int32_t) cores.size();
        const int32_t limit = clover_cgroup_cpu_limit();
        if (limit > 0) {
            n = std::min(n, limit);
        }
        if (n > 0) {
            return n;
        }
    }
#endif
    const unsigned hw = std::thread::hardware_concurrency();
    return hw > 0 ? (int32_t) hw : 1;
}
