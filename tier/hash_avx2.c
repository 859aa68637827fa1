/* hash_avx2.c - the key chain with AVX2 XXH3 (built with -mavx2 on x86-64;
 * kvt__hash_chain picks it only when the CPU has AVX2). */
#define KVT_HASH_CHAIN_NAME kvt__hash_chain_avx2
#include "hash_body.h"
