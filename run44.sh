#!/usr/bin/env bash
# Session 44's GPU run (not committed): the new fusions' GPU tests, their A/B, the figures.
T=tests/unit/test_triton_ops.py
A=tests/unit/test_triton_attention.py
M=tests/model/test_cuda.py
export TEST_FILES=${TEST_FILES:-"$T::test_gate_up_product_with_its_activation_gives_the_two_kernels_bits
 $T::test_gate_up_product_with_two_kernels_when_the_parts_add_in_a_kernel
 $T::test_rotary_and_kv_store_in_one_launch_give_the_two_kernels_bits
 $T::test_programmatic_dependent_launch_gives_the_same_bits
 $T::test_linear_gives_each_row_the_same_bits_in_any_batch
 $A::test_rotary_in_the_kv_store_gives_the_bits_of_rotating_first
 $A::test_each_row_gets_the_same_bits_alone_and_in_any_batch
 $A::test_graph_metadata_gives_the_eager_result
 $M::test_batched_equals_alone_on_cuda $M::test_graph_replays_give_the_eager_tokens"}
export OUT=${OUT:-cuda-out} SERVER=0
if [ "${STAGE:-all}" != bench ]; then
  MAXFAIL=30 TEST_TIMEOUT=${TEST_TIMEOUT:-170} SKIP_BENCH=1 \
    PROFILE=${PROFILE:-default,unfused,mlp-two-kernels,gated-pairs,rope-then-store} \
    PROFILE_ARGS="--rounds 2" PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-150} bash benchmarks/cuda_session.sh
fi
if [ "${STAGE:-all}" != tests ]; then
  SKIP_TESTS=1 BENCH_TIMEOUT=${BENCH_TIMEOUT:-230} BENCH_ARGS="--no-linear ${BENCH_EXTRA:-}" \
    bash benchmarks/cuda_session.sh
fi
