/* Preloaded into every local function runtime (LD_PRELOAD): the process makes itself
 * non-dumpable before the runtime's own code runs, so another process of the same user (another
 * function) cannot read its memory, where the secrets it got on stdin live, through
 * /proc/<pid>/mem, /proc/<pid>/environ or ptrace. Node.js has no prctl of its own; one
 * mechanism serves every runtime. The flag is reset by execve, and LD_PRELOAD is inherited, so
 * what a function starts is non-dumpable too. */
#include <stdio.h>
#include <sys/prctl.h>

__attribute__((constructor)) static void eddy_nondumpable(void) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        perror("eddy: cannot make the function's process non-dumpable");
    }
}
