# conversation: a multi-turn chat through kvshare-serve --device hybrid (issue #23): later
# turns hand over only what the decoder's slot lacks, or are forwarded; replies and KV equal
# the decoder alone's. The reference pair always; the patched llama-server with
# LLAMA_SERVER_KVSHARE=path.
add_test(NAME conversation
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/conversation.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(conversation PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)

# The patched llama-server pair's chat with the decoder on a Vulkan device (issue #42;
# lavapipe in CI): exit 77 = skipped without one, except under CI=true, where it fails.
add_test(NAME llama_server_conversation_vulkan
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/conversation.py ${CMAKE_BINARY_DIR}/bin --vulkan)
set_tests_properties(llama_server_conversation_vulkan PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77 LABELS "llama_server;vulkan")
