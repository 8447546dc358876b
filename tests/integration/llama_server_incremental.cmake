# llama_server_incremental: issue #23's incremental handoff (share with tokens -> n_cached,
# llama-kvshare-prefill --cached, adopt with n_cached) against a llama-server built with the
# patch series (LLAMA_SERVER_KVSHARE=path). Exit 77 = skipped (no such server).
add_test(NAME llama_server_incremental
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_incremental.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_incremental PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77)
