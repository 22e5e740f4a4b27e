/* AMX tile support shared by pagedllm's CPU kernels (amx_linear.c,
 * prefill_attention.c): HAVE_AMX where the compiler targets AMX-BF16, Linux's
 * permission to use the tile state, and the tile configuration layout.
 */
#ifndef PAGEDLLM_CPU_AMX_H
#define PAGEDLLM_CPU_AMX_H

#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX's tile state only to a process that asks for it (torch
 * asks too when oneDNN uses AMX; asking twice is harmless). */
static inline int amx_permitted(void) {
    static int state = -1; /* a racing first call asks twice: same answer */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* ldtilecfg's 64-byte operand (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;
#else
#define HAVE_AMX 0
#endif

#endif
