# llama_server_kvshare: the shared route with a llama-server built with the patch series
# (LLAMA_SERVER_KVSHARE=path, from scripts/build-llama-server.sh --with-kvshare) as the
# decoder and llama-kvshare-prefill as the provider. Exit 77 = skipped (no such server).
add_test(NAME llama_server_kvshare
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/llama_server_kvshare.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_kvshare PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77)
