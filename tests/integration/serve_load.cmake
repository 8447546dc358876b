# serve_load: --handoff auto hands a long prompt off while other slots decode (issue #43), the
# patched llama-server as the decoder (LLAMA_SERVER_KVSHARE=path). Exit 77 = skipped.
add_test(NAME llama_server_serve_load
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/serve_load.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_serve_load PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS llama_server)
