# llama_server_streams: the patched llama-server (LLAMA_SERVER_KVSHARE=path, from
# scripts/build-llama-server.sh --with-kvshare) exports, shares and adopts its KV cache at
# several -c / -np / -kvu splits into streams, with llama-kvshare-prefill as the provider
# (issue #27). Exit 77 = skipped (no such server).
add_test(NAME llama_server_streams
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_streams.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_streams PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS llama_server)
