# memory_kinds: recurrent (mamba2), hybrid (lfm2, qwen35) and iSWA (gemma3) models through
# the shared and the file route, with a llama-server built with the patch series
# (LLAMA_SERVER_KVSHARE=path) and its llama-kvshare-prefill. Exit 77 = skipped (no such server).
add_test(NAME llama_server_memory_kinds
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/memory_kinds.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_memory_kinds PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77 LABELS llama_server)
